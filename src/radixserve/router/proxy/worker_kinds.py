"""Worker kinds: what the router knows of each engine it can front, this project's own
(``radixserve``), vLLM and SGLang. Per kind: how to recognise it, where it publishes its KV
events, how to read its load, how to flush its prefix cache and where its tokenizer is.

The top half is pure: response bodies in, plain data out (unit-tested on the engines' real
answers, tests/router/proxy/test_router_worker_kinds.py). The bottom half, ``WorkerKinds``, asks the workers
over HTTP and keeps per worker what it found, and why not, for the log (said once) and /metrics.

What each kind answers (the shapes these functions read):

- radixserve: ``GET /get_model_info`` (``tokenizer_path``, ``tokenizer_fingerprint``),
  ``GET /get_server_info`` (``kv_events``: ``{"endpoint", "replay_endpoint", "topic"}``),
  ``GET /get_loads`` (``num_running``, ``num_waiting``, ``waiting_prefill_tokens``,
  ``kv_usage``), ``POST /flush_cache``.
- vLLM 0.32 (vllm/entrypoints/serve/kv_events/api_router.py): ``GET /kv_event_sources``, one
  entry per data-parallel rank (``endpoint``, ``replay_endpoint``, ``topic``; a ``*`` host is
  the worker's own), a map keyed by rank or a list; Prometheus ``GET /metrics``
  (``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  0-1, counters ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` in
  tokens); ``POST /reset_prefix_cache`` (served only with ``VLLM_SERVER_DEV_MODE=1``);
  ``GET /v1/models`` (``data[0].root``: the model path it loaded, tokenizer included).
- SGLang 0.5.23 (sglang/srt/runtime_context.py describe_kv_events_publisher): ``GET
  /server_info`` ``kv_events`` = ``{"publisher", "endpoint_host", "endpoint_port_base", "topic",
  "block_size", "dp_size", "replay_endpoint_port_base"?}``, rank r on port base + r;
  ``GET /v1/loads`` (sglang/srt/entrypoints/v1_loads.py: ``{"loads": [{"dp_rank",
  "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "token_usage",
  "cache_hit_rate", ...}]}``), Prometheus ``sglang:num_running_reqs`` /
  ``sglang:num_queue_reqs`` / ``sglang:token_usage`` when that is missing; ``POST
  /flush_cache``; ``GET /model_info`` (``tokenizer_path``). Its events are msgpack tagged arrays
  (event_format.py reads them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("radixserve.router")

KINDS = ("radixserve", "vllm", "sglang")
WORKER_TYPES = ("auto", *KINDS)
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")

Answer = tuple[int, bytes] | None
"""A worker's answer to a GET: (status, body), or None when it could not be asked."""
Get = Callable[[str], Awaitable[Answer]]


# ----- pure: events -----


@dataclass(frozen=True, slots=True)
class EventSource:
    """One KV-event publisher: PUB endpoint, replay endpoint (None: none), topic."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    def info(self) -> dict[str, Any]:
        """In the shape our /get_server_info reports it (kvindex.subscriber reads it)."""
        return {"kv_events": {"publisher": "zmq", "endpoint": self.endpoint,
                              "replay_endpoint": self.replay_endpoint, "topic": self.topic}}  # fmt: skip


def on_worker_host(endpoint: str, worker_url: str) -> str:
    """`endpoint` with a wildcard bind host (``tcp://*:5557``) replaced by the worker's host."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    bind_host, _, port = rest.rpartition(":")
    if bind_host in _WILDCARD_HOSTS:
        host = urlsplit(worker_url).hostname or "127.0.0.1"
        bind_host = f"[{host}]" if ":" in host else host
    return f"tcp://{bind_host}:{port}"


def parse_kv_events(obj: Any, where: str = "kv_events") -> EventSource:
    """A per-worker override, ``{"endpoint", "replay_endpoint"?, "topic"?}``; ValueError
    naming the field when it is not one."""
    if not isinstance(obj, dict):
        raise ValueError(f'{where} must be an object {{"endpoint": "tcp://host:port", ...}}')
    unknown = sorted(set(obj) - {"endpoint", "replay_endpoint", "topic"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    endpoint, replay, topic = obj.get("endpoint"), obj.get("replay_endpoint"), obj.get("topic")
    if not _zmq_endpoint(endpoint):
        raise ValueError(f"{where}.endpoint must be a ZMQ endpoint such as tcp://*:5557")
    if replay is not None and not _zmq_endpoint(replay):
        raise ValueError(f"{where}.replay_endpoint must be a ZMQ endpoint or null")
    if topic is not None and not isinstance(topic, str):
        raise ValueError(f"{where}.topic must be a string")
    return EventSource(endpoint, replay or None, topic or "")


def parse_kv_events_flag(text: str) -> tuple[str, EventSource]:
    """``URL=ENDPOINT[,REPLAY_ENDPOINT[,TOPIC]]`` (one ``--worker-kv-events`` entry)."""
    url, sep, rest = text.partition("=")
    if not sep or not url or not rest:
        raise ValueError(f"--worker-kv-events {text!r}: want URL=ENDPOINT[,REPLAY[,TOPIC]]")
    parts = rest.split(",")
    if len(parts) > 3:
        raise ValueError(f"--worker-kv-events {text!r}: at most ENDPOINT,REPLAY,TOPIC")
    parts += [""] * (3 - len(parts))
    obj = {"endpoint": parts[0], "replay_endpoint": parts[1] or None, "topic": parts[2]}
    return url, parse_kv_events(obj, f"--worker-kv-events {url}")


def _zmq_endpoint(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("tcp://", "ipc://", "inproc://"))


def vllm_event_sources(obj: Any) -> list[EventSource]:
    """vLLM's /kv_event_sources: a map keyed by data-parallel rank, or a list of entries
    (with ``data_parallel_rank``); in rank order. Entries without an endpoint are skipped."""
    if isinstance(obj, dict):
        entries = [v for _, v in sorted(obj.items(), key=lambda kv: _rank(kv[0]))]
    elif isinstance(obj, list):
        entries = sorted(
            obj, key=lambda e: _rank(e.get("data_parallel_rank") if isinstance(e, dict) else None)
        )
    else:
        return []
    out = []
    for e in entries:
        if isinstance(e, dict) and _zmq_endpoint(e.get("endpoint")):
            replay = e.get("replay_endpoint")
            out.append(EventSource(e["endpoint"], replay if _zmq_endpoint(replay) else None,
                                   str(e.get("topic") or "")))  # fmt: skip
    return out


def _rank(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1 << 30


def sglang_event_sources(info: Any) -> list[EventSource]:
    """SGLang's /server_info ``kv_events`` descriptor: rank r publishes on endpoint_port_base + r
    (replay on replay_endpoint_port_base + r) at endpoint_host (a wildcard: the worker's host)."""
    kv = info.get("kv_events") if isinstance(info, dict) else None
    if not isinstance(kv, dict) or kv.get("publisher", "zmq") != "zmq":
        return []
    host, base = kv.get("endpoint_host"), kv.get("endpoint_port_base")
    if not isinstance(host, str) or type(base) is not int:
        return []
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    replay_base = kv.get("replay_endpoint_port_base")
    ranks = kv.get("dp_size") if type(kv.get("dp_size")) is int and kv["dp_size"] > 0 else 1
    topic = str(kv.get("topic") or "")
    return [
        EventSource(
            f"tcp://{host}:{base + r}",
            f"tcp://{host}:{replay_base + r}" if type(replay_base) is int else None,
            topic,
        )
        for r in range(ranks)
    ]


def radixserve_event_sources(info: Any) -> list[EventSource]:
    """Our /get_server_info ``kv_events`` (a map, or its JSON)."""
    kv = info.get("kv_events") if isinstance(info, dict) else None
    if isinstance(kv, str):
        try:
            kv = json.loads(kv)
        except ValueError:
            return []
    if not isinstance(kv, dict) or kv.get("publisher", "zmq") != "zmq":
        return []
    if not _zmq_endpoint(kv.get("endpoint")):
        return []
    replay = kv.get("replay_endpoint")
    return [EventSource(kv["endpoint"], replay if _zmq_endpoint(replay) else None,
                        str(kv.get("topic") or ""))]  # fmt: skip


# ----- pure: loads -----


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's own report of its load (None: it did not say). ``kv_usage`` is 0-1;
    ``prefix_queries`` / ``prefix_hits`` are cumulative prompt tokens looked up / found in its
    prefix cache (vLLM's counters)."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    waiting_prefill_tokens: int | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    kv_load_ratio: float | None = None  # ours: lower-tier load time / prefill time per token


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition: each metric name's value, summed over its label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            values[name.strip()] = values.get(name.strip(), 0.0) + value
    return values


def _count(metrics: Mapping[str, float], *names: str) -> int | None:
    value = _first(metrics, *names)
    return None if value is None else round(value)


def _first(metrics: Mapping[str, float], *names: str) -> float | None:
    return next((metrics[n] for n in names if n in metrics), None)


def vllm_load(metrics: Mapping[str, float]) -> WorkerLoad | None:
    """vLLM's load out of its /metrics (parse_prometheus); None when none of it is there."""
    load = WorkerLoad(
        running=_count(metrics, "vllm:num_requests_running"),
        waiting=_count(metrics, "vllm:num_requests_waiting"),
        kv_usage=_first(metrics, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        prefix_queries=_first(metrics, "vllm:prefix_cache_queries_total",
                              "vllm:prefix_cache_queries"),
        prefix_hits=_first(metrics, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
    )  # fmt: skip
    return None if load == WorkerLoad() else load


def sglang_load(obj: Any) -> WorkerLoad | None:
    """SGLang's /v1/loads, summed over its data-parallel ranks (KV usage: the fullest rank)."""
    loads = obj.get("loads") if isinstance(obj, dict) else None
    if not isinstance(loads, list) or not loads or not all(isinstance(x, dict) for x in loads):
        return None

    def total(key: str) -> int | None:
        vals = [x.get(key) for x in loads]
        return sum(vals) if all(_int(v) for v in vals) else None

    usage = [x.get("token_usage") for x in loads]
    return WorkerLoad(
        running=total("num_running_reqs"),
        waiting=total("num_waiting_reqs"),
        kv_usage=max(usage) if all(_num(u) for u in usage) else None,
        waiting_prefill_tokens=total("num_waiting_uncached_tokens"),
    )


def sglang_metrics_load(metrics: Mapping[str, float]) -> WorkerLoad | None:
    """SGLang's load out of its Prometheus /metrics (older servers without /v1/loads)."""
    load = WorkerLoad(
        running=_count(metrics, "sglang:num_running_reqs"),
        waiting=_count(metrics, "sglang:num_queue_reqs"),
        kv_usage=_first(metrics, "sglang:token_usage"),
    )
    return None if load == WorkerLoad() else load


def radixserve_load(obj: Any) -> WorkerLoad | None:
    """Our /get_loads."""
    if not isinstance(obj, dict):
        return None
    get = {k: obj.get(k) for k in ("num_running", "num_waiting", "waiting_prefill_tokens")}
    kv, ratio = obj.get("kv_usage"), obj.get("kv_load_to_prefill_ratio")
    load = WorkerLoad(
        running=get["num_running"] if _int(get["num_running"]) else None,
        waiting=get["num_waiting"] if _int(get["num_waiting"]) else None,
        kv_usage=float(kv) if _num(kv) else None,
        waiting_prefill_tokens=(
            get["waiting_prefill_tokens"] if _int(get["waiting_prefill_tokens"]) else None
        ),
        kv_load_ratio=float(ratio) if _num(ratio) and ratio >= 0 else None,
    )
    return None if load == WorkerLoad() else load


def _int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# ----- pure: recognising a kind, flushing -----


def detect_kind(answers: Mapping[str, Answer]) -> str | None:
    """The kind of a worker from its answers to DETECT_PATHS; None when it answered none of
    them (down, or not an engine this router knows)."""

    def obj(path: str) -> Any:
        ans = answers.get(path)
        if ans is None or ans[0] != 200:
            return None
        try:
            return json.loads(ans[1])
        except ValueError:
            return None

    server_info, sources = obj("/server_info"), obj("/kv_event_sources")
    by_rank = isinstance(sources, dict) and all(isinstance(v, dict) for v in sources.values())
    if (
        by_rank
        or isinstance(sources, list)
        or (isinstance(server_info, dict) and "vllm_config" in server_info)
    ):
        return "vllm"  # (vLLM in dev mode serves /server_info too: {"vllm_config": ...})
    info = obj("/get_model_info")
    if isinstance(info, dict) and "tokenizer_fingerprint" in info:
        return "radixserve"
    if isinstance(server_info, dict) or isinstance(info, dict):
        return "sglang"  # /get_model_info without our fingerprint: an SGLang before /server_info
    version = obj("/version")
    if isinstance(version, dict) and "version" in version:
        return "vllm"  # a vLLM before /kv_event_sources
    return None


UNKNOWN_RETRY_SECS = 30.0
DETECT_PATHS = ("/kv_event_sources", "/get_model_info", "/server_info", "/version")

FLUSH = {
    "radixserve": ("POST", "/flush_cache"),
    "vllm": ("POST", "/reset_prefix_cache"),
    "sglang": ("POST", "/flush_cache"),
}


def flush_failure(kind: str | None, status: int) -> str:
    """Why a flush answered `status`, in words an operator can act on."""
    if kind == "vllm" and status == 404:
        return "404: vLLM serves /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1"
    if status in (400, 409):
        return f"{status}: the worker refused (requests running or waiting?)"
    return f"status {status}"


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
                    own = _json(await get("/get_server_info"))
                    if isinstance(own, dict) and "kv_store" in own:
                        out["kv_store"] = own["kv_store"]
                return out
            obj = _json(await get(path))
            return obj if isinstance(obj, dict) else None

        return fetch

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
            load = sglang_load(_json(await get("/v1/loads")))
            if load is None:
                answer = await get("/metrics")
                if answer is not None and answer[0] == 200:
                    load = sglang_metrics_load(
                        parse_prometheus(answer[1].decode("utf-8", "replace"))
                    )
        elif state.kind == "radixserve":
            load = radixserve_load(_json(await get("/get_loads")))
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


def tokenizer_info(kind: str, obj: Any) -> dict[str, Any] | None:
    """The tokenizer a worker names, in our /get_model_info shape: vLLM's /v1/models
    ``data[0].root``, SGLang's /model_info ``tokenizer_path``, ours as it is."""
    if not isinstance(obj, dict):
        return None
    if kind == "vllm":
        data = obj.get("data")
        card = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        root = card.get("root")
        return {"tokenizer_path": root} if isinstance(root, str) and root else None
    tok = obj.get("tokenizer_path") or obj.get("model_path")
    if kind == "sglang":
        return {"tokenizer_path": tok} if isinstance(tok, str) and tok else None
    return obj


def _json(answer: Answer) -> Any:
    if answer is None or answer[0] != 200:
        return None
    try:
        return json.loads(answer[1])
    except ValueError:
        return None


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
