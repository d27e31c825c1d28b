"""Worker shapes: what the router knows of each engine it can front, this project's own
(``radixserve``), vLLM and SGLang. Per kind: how to recognise it, where it publishes its KV
events, how to read its load, how to flush its prefix cache and where its tokenizer is.

Pure: response bodies in, plain data out, no I/O (unit-tested on the engines' real answers,
tests/router/proxy/test_router_worker_kinds.py; import-linter keeps it pure). worker_kinds.py
asks the workers over HTTP and keeps per worker what it found.

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

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

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

HOST_RATIO = "kv_load_to_prefill_ratio"  # our engines' names for their two ratios
STORE_RATIO = "kv_store_load_to_prefill_ratio"


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
    kv_load_ratio: float | None = None  # ours: host-tier load time / prefill time per token
    kv_store_load_ratio: float | None = None  # ours: the same from the KV store


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
    kv = obj.get("kv_usage")
    load = WorkerLoad(
        running=get["num_running"] if _int(get["num_running"]) else None,
        waiting=get["num_waiting"] if _int(get["num_waiting"]) else None,
        kv_usage=float(kv) if _num(kv) else None,
        waiting_prefill_tokens=(
            get["waiting_prefill_tokens"] if _int(get["waiting_prefill_tokens"]) else None
        ),
        kv_load_ratio=_ratio(obj.get(HOST_RATIO)),
        kv_store_load_ratio=_ratio(obj.get(STORE_RATIO)),
    )
    return None if load == WorkerLoad() else load


def server_load_ratio(info: Any, key: str = HOST_RATIO) -> float | None:
    """A load-to-prefill ratio our /get_server_info reports (``key``: the host tier's
    ``kv_load_to_prefill_ratio`` or the store's ``kv_store_load_to_prefill_ratio``, at the top
    or in its ``engine`` facts): seconds to load a token's KV into the device pool over seconds
    to prefill one, as the engine measures them. None where it says none (nothing measured
    yet, another kind): kv_aware charges its default."""
    if not isinstance(info, dict):
        return None
    ratio = info.get(key)
    engine = info.get("engine")
    if ratio is None and isinstance(engine, dict):
        ratio = engine.get(key)
    return _ratio(ratio)


def _ratio(v: Any) -> float | None:
    return float(v) if _num(v) and v >= 0 else None


def _int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# ----- pure: recognising a kind, flushing -----


def json_of(answer: Answer) -> Any:
    """The JSON of a 200 answer; None for no answer, another status or a body that is not JSON."""
    if answer is None or answer[0] != 200:
        return None
    try:
        return json.loads(answer[1])
    except ValueError:
        return None


def detect_kind(answers: Mapping[str, Answer]) -> str | None:
    """The kind of a worker from its answers to DETECT_PATHS; None when it answered none of
    them (down, or not an engine this router knows)."""

    def obj(path: str) -> Any:
        return json_of(answers.get(path))

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


# ----- pure: the tokenizer a worker names -----


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
