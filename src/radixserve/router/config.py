"""RouterConfig: every setting of `radixserve route`, one frozen dataclass whose fields become the
command-line flags (named as sglang-router's where it has them)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from typing import Any

from radixserve.router.policies import POLICIES, CachePolicyConfig
from radixserve.router.worker_kinds import WORKER_TYPES, EventSource, parse_kv_events_flag


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Health-check and circuit-breaker settings: the slice of RouterConfig that workers.py uses."""

    interval_secs: float = 2.0
    timeout_secs: float = 2.0
    failure_threshold: int = 2
    success_threshold: int = 1
    endpoint: str = "/health"
    cb_failure_threshold: int = 3
    cb_success_threshold: int = 1
    cb_timeout_secs: float = 5.0
    connect_timeout_secs: float = 5.0
    max_conns: int = 0
    overload_waiting: int = 0  # 0: off
    overload_kv_usage: float = 0.0  # 0: off


_POLICY = CachePolicyConfig()
_HEALTH = HealthConfig()


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class RouterConfig:
    worker_urls: tuple[str, ...] = _f(
        (), "workers to route to at start (more can be added later)", metavar="URL"
    )
    policy: str = _f("cache_aware", "routing policy", choices=tuple(sorted(POLICIES)))
    worker_type: str = _f(
        "auto",
        "what the --worker-urls run: radixserve, vllm or sglang (auto: recognised by their "
        "endpoints); sets where KV events, load and flush are found",
        choices=WORKER_TYPES,
    )
    worker_kv_events: tuple[str, ...] = _f(
        (),
        "a worker's KV-event publisher, overriding what it reports: URL=ENDPOINT[,REPLAY[,TOPIC]] "
        "(a * host is the worker's host), e.g. http://h:8000=tcp://*:5557,tcp://*:5558,kv",
        metavar="URL=ENDPOINT",
    )
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(30000, "port to listen on")
    cache_threshold: float = _f(
        _POLICY.cache_threshold, "cache_aware: least prefix match rate that keeps a request local"
    )
    balance_abs_threshold: int = _f(
        _POLICY.balance_abs_threshold, "cache_aware: load gap (requests) tolerated for locality"
    )
    balance_rel_threshold: float = _f(
        _POLICY.balance_rel_threshold, "cache_aware: load ratio tolerated for locality"
    )
    share_slack: float = _f(
        _POLICY.share_slack,
        "cache_aware: a prefix's holder sent more than this fraction above the mean share of "
        "recent requests spills hits to the least-sent worker (inf: never)",
    )
    warmup_secs: float = _f(
        _POLICY.warmup_secs,
        "cache_aware: a worker that joins under traffic takes at most its fair share of new "
        "prefixes at first, rising to no cap over this many seconds (0: off)",
    )
    eviction_interval_secs: float = _f(
        _POLICY.eviction_interval_secs, "cache_aware: seconds between tree evictions (0: never)"
    )
    max_tree_size: int = _f(
        _POLICY.max_tree_size,
        "cache_aware: tree units kept per worker (8 prompt bytes; a node costs 60)",
    )
    cache_aware_scheduling_min_tokens: int = _f(
        _POLICY.cache_aware_scheduling_min_tokens,
        "kv_aware: prompts shorter than this (tokens) are placed by load alone",
    )
    kv_index: str = _f(
        "memory",
        "kv_aware: where the precise prefix index lives: memory (the router subscribes to the "
        "workers' KV events) or redis://host:port/db (shared; `radixserve kv-indexer` writes it)",
    )
    kvs_retry_times: int = _f(
        5, "kv_aware on Redis: retries of a failed lookup before the service is marked down"
    )
    kvs_retry_interval_ms: float = _f(100.0, "kv_aware on Redis: wait between lookup retries")
    kvs_metadata_service_down_duration_s: float = _f(
        30.0,
        "kv_aware on Redis: seconds a down service is left alone (routing falls back to the "
        "approximate tree) before it is tried again",
    )
    kvs_timeout_ms: float = _f(
        500.0,
        "kv_aware on Redis: a lookup slower than this failed (keep it above the router's own "
        "p99 latency: a saturated router reads replies late)",
    )
    redis_prefix: str = _f(
        "radixserve",
        "kv_aware on Redis: prefix of the index's keys (the kv-indexer's --redis-prefix)",
    )
    tokenizer: str | None = _f(
        None,
        "kv_aware: the workers' tokenizer (model dir or GGUF; default: what the workers report "
        "in /get_model_info)",
    )
    api_key: str | None = _f(None, "bearer key required on inference endpoints")
    admin_api_key: str | None = _f(
        None,
        "bearer key required on worker management; without one, management is answered to "
        "loopback clients only (an --api-key never grants it)",
    )
    worker_api_key: str | None = _f(
        None, "bearer key sent to workers (default: forward the client's Authorization)"
    )
    max_payload_size: int = _f(
        32 * 2**20, "largest request body in bytes, as `serve`'s (larger: 413)"
    )
    max_url_size: int = _f(8192, "longest request URL in bytes (longer: 414; nginx: 8 KiB)")
    max_header_size: int = _f(
        16384, "largest request head (header lines) in bytes (larger: 431; uvicorn: 16 KiB)"
    )
    header_timeout_secs: float = _f(
        30.0, "a request head must arrive within this (else 408; nginx: 60 s)"
    )
    body_timeout_secs: float = _f(
        30.0, "longest pause between pieces of a request body (else 408; nginx: 60 s)"
    )
    keep_alive_timeout_secs: float = _f(
        75.0, "an idle keep-alive client connection is closed after this (nginx: 75 s)"
    )
    max_connections: int = _f(4096, "client connections at once; more are answered 503 and closed")
    connect_timeout_secs: float = _f(5.0, "longest wait to connect to a worker")
    stream_timeout_secs: float = _f(
        300.0, "longest a worker may send nothing while answering (nginx: 60 s)"
    )
    max_worker_connections: int = _f(
        1024, "connections to one worker at once; more requests wait (0: no cap)"
    )
    max_concurrent_requests: int = _f(
        2048, "inference requests in flight at once (0: no cap); more wait in the queue"
    )
    queue_size: int = _f(
        1024, "requests that may wait for a slot; more are answered 503 with Retry-After"
    )
    queue_timeout_secs: float = _f(60.0, "longest wait in the queue (then 503 with Retry-After)")
    overload_waiting_threshold: int = _f(
        0,
        "steer away from a worker whose reported waiting queue exceeds this; all past it: "
        "503 with Retry-After (read from /get_server_info at each health check; 0: off)",
    )
    overload_kv_usage_threshold: float = _f(
        0.0, "as --overload-waiting-threshold, for the reported KV cache usage (0-1; 0: off)"
    )
    session_header: str = _f(
        "X-Session-Id", "consistent_hashing: the request header that names the session"
    )
    request_timeout_secs: float = _f(1800.0, "longest a worker may take over one request")
    max_retries: int = _f(
        3, "attempts on other workers after a connect error, 502, 503 or 504 (jittered backoff)"
    )
    retry_backoff_ms: float = _f(10.0, "wait before the first retry; doubles for each next one")
    retry_max_backoff_ms: float = _f(1000.0, "longest wait between retries")
    health_check_interval_secs: float = _f(
        _HEALTH.interval_secs, "seconds between health probes of each worker (0: no probes)"
    )
    health_check_timeout_secs: float = _f(_HEALTH.timeout_secs, "a probe slower than this fails")
    health_failure_threshold: int = _f(
        _HEALTH.failure_threshold, "failed probes in a row that take a worker out of routing"
    )
    health_success_threshold: int = _f(
        _HEALTH.success_threshold, "passed probes in a row that bring it back"
    )
    health_check_endpoint: str = _f(_HEALTH.endpoint, "path probed on each worker")
    cb_failure_threshold: int = _f(
        _HEALTH.cb_failure_threshold,
        "failed requests in a row that open a worker's circuit (0: off)",
    )
    cb_success_threshold: int = _f(
        _HEALTH.cb_success_threshold, "successes that close a half-open circuit"
    )
    cb_timeout_duration_secs: float = _f(
        _HEALTH.cb_timeout_secs, "seconds an open circuit waits before letting requests try"
    )
    log_level: str = _f("info", "logging level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}")
        if self.max_retries < 0 or self.max_payload_size <= 0 or self.request_timeout_secs <= 0:
            raise ValueError("max_retries >= 0, max_payload_size > 0, request_timeout_secs > 0")
        limits = (self.max_url_size, self.max_header_size, self.max_connections)
        timeouts = (self.header_timeout_secs, self.body_timeout_secs, self.connect_timeout_secs,
                    self.keep_alive_timeout_secs, self.stream_timeout_secs)  # fmt: skip
        caps = (self.max_worker_connections, self.max_concurrent_requests, self.queue_size)
        if min(limits) < 1 or min(timeouts) <= 0 or min(caps) < 0 or self.queue_timeout_secs <= 0:
            raise ValueError("size limits, connection caps and timeouts must be positive")
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ValueError("health thresholds must be >= 1")
        self._check_kv_index()
        # argparse hands over a list; keep the frozen config hashable and immutable.
        object.__setattr__(self, "worker_urls", tuple(self.worker_urls))
        if self.worker_type not in WORKER_TYPES:
            raise ValueError(f"--worker-type must be one of {', '.join(WORKER_TYPES)}")
        object.__setattr__(self, "worker_kv_events", tuple(self.worker_kv_events))
        self.kv_event_overrides()  # a malformed entry is a one-line error now
        self.policy_config()  # validates the policy's own ranges now, not at first request

    def _check_kv_index(self) -> None:
        if self.kv_index == "memory":
            redis_only = ("kvs_retry_times", "kvs_retry_interval_ms", "kvs_timeout_ms",
                          "kvs_metadata_service_down_duration_s", "redis_prefix")  # fmt: skip
            defaults = {f.name: f.default for f in fields(self)}
            set_ = [n for n in redis_only if getattr(self, n) != defaults[n]]
            if set_:
                flags = ", ".join("--" + n.replace("_", "-") for n in set_)
                raise ValueError(f"{flags}: for --kv-index redis://... only")
            return
        if not self.kv_index.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--kv-index must be memory or a redis:// URL, not {self.kv_index!r}")
        if self.policy != "kv_aware":
            raise ValueError("--kv-index redis://... is read by --policy kv_aware only")
        if importlib.util.find_spec("redis") is None:
            raise ValueError("--kv-index redis://... needs redis-py: pip install radixserve[redis]")
        if self.kvs_retry_times < 0 or self.kvs_retry_interval_ms < 0 or self.kvs_timeout_ms <= 0:
            raise ValueError("kvs_retry_times, kvs_retry_interval_ms >= 0; kvs_timeout_ms > 0")
        if self.kvs_metadata_service_down_duration_s < 0:
            raise ValueError("kvs_metadata_service_down_duration_s must be >= 0")

    def kv_event_overrides(self) -> dict[str, EventSource]:
        """--worker-kv-events as {worker url: publisher}."""
        return dict(parse_kv_events_flag(entry) for entry in self.worker_kv_events)

    def policy_config(self) -> CachePolicyConfig:
        return CachePolicyConfig.taken_from(self)

    def health_config(self) -> HealthConfig:
        return HealthConfig(
            interval_secs=self.health_check_interval_secs,
            timeout_secs=self.health_check_timeout_secs,
            failure_threshold=self.health_failure_threshold,
            success_threshold=self.health_success_threshold,
            endpoint=self.health_check_endpoint,
            cb_failure_threshold=self.cb_failure_threshold,
            cb_success_threshold=self.cb_success_threshold,
            cb_timeout_secs=self.cb_timeout_duration_secs,
            connect_timeout_secs=self.connect_timeout_secs,
            max_conns=self.max_worker_connections,
            overload_waiting=self.overload_waiting_threshold,
            overload_kv_usage=self.overload_kv_usage_threshold,
        )
