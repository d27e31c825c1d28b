"""Worker kinds, the I/O half: ``WorkerKinds`` asks each worker over HTTP (with the pure
readers of worker_shapes.py) and keeps per worker what it found, and why not, for the log (said
once) and /metrics; ``http_get`` over a worker's connection pool; ``kind_families`` for /metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from radixserve.router.proxy.worker_shapes import (
    DETECT_PATHS,
    STORE_RATIO,
    WORKER_TYPES,
    Answer,
    EventSource,
    Get,
    WorkerLoad,
    detect_kind,
    json_of,
    on_worker_host,
    parse_prometheus,
    radixserve_event_sources,
    radixserve_load,
    server_load_ratio,
    sglang_event_sources,
    sglang_load,
    sglang_metrics_load,
    tokenizer_info,
    vllm_event_sources,
    vllm_load,
)

log = logging.getLogger("radixserve.router")

UNKNOWN_RETRY_SECS = 30.0


# ----- I/O: per worker, what was found -----


@dataclass(slots=True)
class KindState:
    """What the router found out about one worker."""

    kind: str | None = None  # None: not recognised yet
    given: bool = False  # set by --worker-type / "type", not detected
    override: EventSource | None = None  # --worker-kv-events / "kv_events"
    source: EventSource | None = None  # the publisher followed
    events_why: str = "not looked up yet"  # why its events are not followed ("" if they are)
    load: WorkerLoad | None = None
    load_at: float = float("-inf")
    load_ratio: float | None = None  # ours: kv_load_to_prefill_ratio from /get_server_info
    store_load_ratio: float | None = None  # ours: kv_store_load_to_prefill_ratio, from there
    unknown_until: float = float("-inf")  # answered, but as no kind known: ask again after
    said: set[str] = field(default_factory=set)


class WorkerKinds:
    """Each worker's kind and what the router could find of it. ``default_type``: the
    --worker-type (``auto``: detect); ``overrides``: {worker url: EventSource}."""

    def __init__(
        self, default_type: str = "auto", overrides: Mapping[str, EventSource] = {}
    ) -> None:
        if default_type not in WORKER_TYPES:
            raise ValueError(f"worker type {default_type!r}: choose from {', '.join(WORKER_TYPES)}")
        self.default_type = default_type
        self.overrides = dict(overrides)
        self.states: dict[str, KindState] = {}

    def register(self, worker_id: str, url: str, kind: str | None = None,
                 override: EventSource | None = None) -> KindState:  # fmt: skip
        """A worker joined: its given type (None: the default) and events override."""
        kind = kind or self.default_type
        if kind not in WORKER_TYPES:
            raise ValueError(f"type {kind!r}: choose from {', '.join(WORKER_TYPES)}")
        state = KindState(override=override or self.overrides.get(url))
        if kind != "auto":
            state.kind, state.given = kind, True
        self.states[worker_id] = state
        return state

    def state(self, worker_id: str) -> KindState:
        return self.states.setdefault(worker_id, KindState())

    def forget(self, worker_id: str) -> None:
        self.states.pop(worker_id, None)

    def say(self, worker_id: str, url: str, what: str, level: int = logging.WARNING) -> None:
        """Log `what` about a worker once (the same words are not repeated)."""
        state = self.state(worker_id)
        if what not in state.said:
            state.said.add(what)
            log.log(level, "worker %s (%s): %s", worker_id, url, what)

    async def identify(self, worker_id: str, url: str, get: Get) -> str | None:
        """The worker's kind, detected on first success (None while it answers nothing)."""
        state = self.state(worker_id)
        if state.kind is not None or time.monotonic() < state.unknown_until:
            return state.kind
        paths = DETECT_PATHS
        answers = dict(zip(paths, await asyncio.gather(*(get(p) for p in paths))))
        state.kind = detect_kind(answers)
        if state.kind is not None:
            self.say(worker_id, url, f"recognised as a {state.kind} worker", logging.INFO)
        elif any(a is not None for a in answers.values()):
            state.unknown_until = time.monotonic() + UNKNOWN_RETRY_SECS  # not at every probe
            self.say(worker_id, url, "answers none of " + ", ".join(paths) + ": kind unknown "
                     "(give --worker-type or \"type\"); its load and KV events are not read")  # fmt: skip
        return state.kind

    async def event_source(self, worker_id: str, url: str, get: Get) -> EventSource | None | bool:
        """The publisher to follow for this worker: an EventSource, False when it publishes
        none that the router can follow (the reason kept and said), None when the worker
        cannot be asked yet (ask again later)."""
        state = self.state(worker_id)
        if state.override is not None:
            return self._follow(worker_id, url, state.override, "given")
        kind = await self.identify(worker_id, url, get)
        if kind is None:
            return None
        path = {"vllm": "/kv_event_sources", "sglang": "/server_info"}.get(kind, "/get_server_info")
        answer = await get(path)
        if kind == "sglang" and answer is not None and answer[0] == 404:
            path, answer = "/get_server_info", await get("/get_server_info")  # before /server_info
        if answer is None:
            return None
        status, body = answer
        if status != 200:
            return self._none(worker_id, url, f"{path} answered {status}" + (
                "; give kv_events (vLLM before 0.32?)" if kind == "vllm" else ""))  # fmt: skip
        try:
            obj = json.loads(body)
        except ValueError:
            return self._none(worker_id, url, f"{path} is not JSON")
        parse = {"vllm": vllm_event_sources, "sglang": sglang_event_sources}
        sources = parse.get(kind, radixserve_event_sources)(obj)
        if not sources:
            hint = {"vllm": "start vLLM with --kv-events-config (publisher zmq)",
                    "sglang": "start SGLang with --kv-events-config"}.get(kind, "start it with --kv-events-config")  # fmt: skip
            return self._none(worker_id, url, f"publishes no KV events ({path}): {hint}")
        if len(sources) > 1:
            self.say(worker_id, url, f"{len(sources)} KV-event publishers (data-parallel "
                     "ranks); following rank 0 only")  # fmt: skip
        return self._follow(worker_id, url, sources[0], path)

    def _follow(self, worker_id: str, url: str, source: EventSource, where: str) -> EventSource:
        state = self.state(worker_id)
        state.source = EventSource(
            on_worker_host(source.endpoint, url),
            on_worker_host(source.replay_endpoint, url) if source.replay_endpoint else None,
            source.topic,
        )
        state.events_why = ""
        if state.source.replay_endpoint is None:
            self.say(worker_id, url, "its KV-event publisher has no replay endpoint: a gap in "
                     "the events drops its entries until new ones arrive")  # fmt: skip
        self.say(worker_id, url, f"KV events at {state.source.endpoint} ({where})", logging.INFO)
        return state.source

    def _none(self, worker_id: str, url: str, why: str) -> bool:
        self.state(worker_id).events_why = why
        self.say(worker_id, url, "KV events not followed: " + why)
        return False

    def not_following(self, worker_id: str, url: str, why: str) -> None:
        """The router does not follow this worker's events at all (policy, shared index)."""
        state = self.state(worker_id)
        state.events_why = why

    async def model_info(self, worker_id: str, url: str, get: Get) -> dict[str, Any] | None:
        """The worker's model info in our /get_model_info shape (``tokenizer_path`` a local
        path the router can load; ``tokenizer_fingerprint`` where the worker gives one); None
        when it cannot be asked or names nothing loadable (said once)."""
        kind = await self.identify(worker_id, url, get)
        if kind is None:
            return None
        path = {"vllm": "/v1/models", "sglang": "/model_info"}.get(kind, "/get_model_info")
        answer = await get(path)
        if answer is None or answer[0] != 200:
            if kind == "sglang":
                answer = await get("/get_model_info")
            if answer is None or answer[0] != 200:
                return None
        try:
            obj = json.loads(answer[1])
        except ValueError:
            return None
        info = tokenizer_info(kind, obj)
        tok = info.get("tokenizer_path") if info else None
        if kind == "vllm" and not (isinstance(tok, str) and os.path.exists(tok)):
            self.say(worker_id, url, f"serves its model from {tok!r}, not a path on this host: "
                     "give --tokenizer for kv_aware to use its KV events")  # fmt: skip
            return None
        return info

    def adapter(self, worker_id: str, url: str, get: Get) -> Callable[[str], Awaitable[Any]]:
        """The worker's answers to the two questions kv_aware asks every worker, in our own
        shapes whatever its kind: ``/get_model_info`` (its tokenizer) and ``/get_server_info``
        (``kv_events``; ``{}``: it publishes none; None: ask again later; ours also passes on
        its ``kv_store``, the store segment it holds, for --kv-index mooncake://)."""

        async def fetch(path: str) -> dict[str, Any] | None:
            if path == "/get_model_info":
                return await self.model_info(worker_id, url, get)
            if path == "/get_server_info":
                source = await self.event_source(worker_id, url, get)
                if source is None:
                    return None
                out = {} if source is False else source.info()
                if self.state(worker_id).kind == "radixserve":
                    own = json_of(await get("/get_server_info"))
                    if isinstance(own, dict) and "kv_store" in own:
                        out["kv_store"] = own["kv_store"]
                    state = self.state(worker_id)
                    state.load_ratio = server_load_ratio(own)
                    state.store_load_ratio = server_load_ratio(own, STORE_RATIO)
                return out
            obj = json_of(await get(path))
            return obj if isinstance(obj, dict) else None

        return fetch

    def load_ratio(self, worker_id: str) -> float | None:
        """What loading a token's KV from its host tier costs the worker against prefilling
        it: its last load report's, else its server info's (None: it says nothing)."""
        return self.load_ratios(worker_id)[0]

    def load_ratios(self, worker_id: str) -> tuple[float | None, float | None]:
        """The host tier's and the KV store's load-to-prefill ratios, each its last load
        report's, else its server info's (None: it says nothing)."""
        state = self.states.get(worker_id)
        if state is None:
            return None, None
        load = state.load or WorkerLoad()
        host, store = load.kv_load_ratio, load.kv_store_load_ratio
        return (host if host is not None else state.load_ratio,
                store if store is not None else state.store_load_ratio)  # fmt: skip

    def reported(self, worker_id: str) -> WorkerLoad | None:
        """The load the worker last reported (None: it does not report one)."""
        state = self.states.get(worker_id)
        return None if state is None else state.load

    async def read_load(self, worker_id: str, url: str, get: Get) -> WorkerLoad | None:
        """Ask the worker for its load (by kind); kept, and returned. None: it did not say."""
        state = self.state(worker_id)
        asked = time.monotonic()
        load = None
        if state.kind == "vllm":
            answer = await get("/metrics")
            if answer is not None and answer[0] == 200:
                load = vllm_load(parse_prometheus(answer[1].decode("utf-8", "replace")))
        elif state.kind == "sglang":
            load = sglang_load(json_of(await get("/v1/loads")))
            if load is None:
                answer = await get("/metrics")
                if answer is not None and answer[0] == 200:
                    load = sglang_metrics_load(
                        parse_prometheus(answer[1].decode("utf-8", "replace"))
                    )
        elif state.kind == "radixserve":
            load = radixserve_load(json_of(await get("/get_loads")))
        if load is None and state.kind is not None:
            self.say(worker_id, url, "reports no load the router can read: only requests sent "
                     "through this router are counted")  # fmt: skip
        state.load, state.load_at = load, asked if load is not None else float("-inf")
        return load

    def info(self, worker_id: str) -> dict[str, Any]:
        """For /workers: kind, the publisher followed (or why not), the last load read."""
        s = self.states.get(worker_id) or KindState()
        out: dict[str, Any] = {"type": s.kind, "type_given": s.given}
        out["kv_events"] = (
            {"endpoint": s.source.endpoint, "replay_endpoint": s.source.replay_endpoint,
             "topic": s.source.topic} if s.source and not s.events_why else None
        )  # fmt: skip
        if s.events_why:
            out["kv_events_not_followed"] = s.events_why
        if s.load is not None:
            out["reported_load"] = {k: getattr(s.load, k) for k in WorkerLoad.__slots__}
        return out


def http_get(request: Callable[..., Awaitable[Any]], headers: bytes = b"",
             timeout: float = 5.0) -> Get:  # fmt: skip
    """A Get over a worker's connection pool (`request`: ConnectionPool.request)."""

    async def get(path: str) -> Answer:
        try:
            resp = await asyncio.wait_for(
                request("GET", path, timeout=timeout, headers=headers), timeout
            )
        except (OSError, ConnectionError, asyncio.TimeoutError):
            return None
        return resp.status, resp.body

    return get


def kind_families(
    kinds: WorkerKinds, workers: Iterable[Any], subscribers: Mapping[Any, Any]
) -> Iterator[Any]:
    """Per worker (labelled by url), for the router's /metrics: its kind, whether its KV events
    are followed and why not, the last seq applied and its lag, and the load it reported."""
    from prometheus_client.core import GaugeMetricFamily

    prefix = "radixserve_router_worker_"
    kind = GaugeMetricFamily(
        prefix + "kind_info", "the worker's kind (1)", labels=["worker", "kind"]
    )
    following = GaugeMetricFamily(
        prefix + "kv_events_following",
        "1 if its KV events feed the index; reason: why not",
        labels=["worker", "reason"],
    )
    seq = GaugeMetricFamily(
        prefix + "kv_events_last_seq", "last event batch applied", labels=["worker"]
    )
    lag = GaugeMetricFamily(
        prefix + "kv_events_lag_seconds", "last batch: received minus published", labels=["worker"]
    )
    loads = {name: GaugeMetricFamily(prefix + "reported_" + name, f"the worker's own report: {name}",
                                     labels=["worker"]) for name in WorkerLoad.__slots__}  # fmt: skip
    for w in workers:
        state = kinds.states.get(w.id) or KindState()
        kind.add_metric([w.url, state.kind or "unknown"], 1.0)
        sub = subscribers.get(w.id)
        why = "" if sub is not None else (state.events_why or "not subscribed")
        following.add_metric([w.url, why], 0.0 if why else 1.0)
        if sub is not None and sub.last_seq is not None:
            seq.add_metric([w.url], float(sub.last_seq))
        if sub is not None and sub.lag_secs is not None:
            lag.add_metric([w.url], sub.lag_secs)
        for name, family in loads.items():
            value = getattr(state.load, name) if state.load is not None else None
            if value is not None:
                family.add_metric([w.url], float(value))
    yield from (kind, following, seq, lag, *loads.values())
