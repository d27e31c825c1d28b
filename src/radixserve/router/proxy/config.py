"""RouterConfig: every setting of `radixserve route`, one frozen dataclass whose fields become the
command-line flags (named as sglang-router's where it has them). The policies' settings
(CachePolicyConfig) and the workers' health settings (HealthConfig) are nested in it whole, so
each setting is declared once; their fields are flags under their own names."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, fields
from typing import Any

from radixserve.config import TraceConfig, check_fields
from radixserve.router.discovery import DiscoveryConfig
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.registry import POLICIES, policy_names
from radixserve.router.proxy.worker_shapes import (
    WORKER_TYPES,
    EventSource,
    parse_kv_events_flag,
)

TOKENIZE_WORKERS = max(1, min(4, (os.cpu_count() or 2) - 1))
"""--tokenize-workers' default: tokenizing threads beyond the cores but one take CPU from the
event loop (on 2 cores, 4 threads left the loop a fifth of the process's share)."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Health checks, circuit breaker and connections to the workers: the settings workers.py
    uses, nested whole into RouterConfig (its fields are `route`'s flags, under these names)."""

    health_check_interval_secs: float = _f(
        2.0, "seconds between health probes of each worker (0: no probes)", ge=0
    )
    health_check_timeout_secs: float = _f(2.0, "a probe slower than this fails", gt=0)
    health_failure_threshold: int = _f(
        2, "failed probes in a row that take a worker out of routing", ge=1
    )
    health_success_threshold: int = _f(1, "passed probes in a row that bring it back", ge=1)
    health_check_endpoint: str = _f("/health", "path probed on each worker")
    cb_failure_threshold: int = _f(
        3, "failed requests in a row that open a worker's circuit (0: off)", ge=0
    )
    cb_success_threshold: int = _f(1, "successes that close a half-open circuit", ge=1)
    cb_timeout_duration_secs: float = _f(
        5.0, "seconds an open circuit waits before letting requests try", gt=0
    )
    connect_timeout_secs: float = _f(5.0, "longest wait to connect to a worker", gt=0)
    max_worker_connections: int = _f(
        1024, "connections to one worker at once; more requests wait (0: no cap)", ge=0
    )
    overload_waiting_threshold: int = _f(
        0,
        "steer away from a worker whose reported waiting queue exceeds this; all past it: "
        "503 with Retry-After (read from /get_server_info at each health check; 0: off)",
        ge=0,
    )
    overload_kv_usage_threshold: float = _f(
        0.0,
        "as --overload-waiting-threshold, for the reported KV cache usage (0-1; 0: off)",
        ge=0,
        le=1,
    )

    def __post_init__(self) -> None:
        check_fields(self)  # the bounds in each field's metadata, named by its flag
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ValueError("health thresholds must be >= 1")
        if self.connect_timeout_secs <= 0 or self.max_worker_connections < 0:
            raise ValueError("size limits, connection caps and timeouts must be positive")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    worker_urls: tuple[str, ...] = _f(
        (), "workers to route to at start (more can be added later)", metavar="URL"
    )
    policy: str = _f("cache_aware", "routing policy", choices=policy_names())
    pd_disaggregation: bool = _f(
        False,
        "prefill and decode on different engines: each request goes at once to a prefill "
        "worker (--prefill) and a decode worker (--decode) with SGLang's bootstrap fields; the "
        "client gets the decode worker's answer",
    )
    prefill: tuple[tuple[str, int | None], ...] = _f(
        (),
        "PD: a prefill worker and its --disaggregation-bootstrap-port (default 8998); repeat "
        "the flag for more",
        metavar=("URL", "BOOTSTRAP_PORT"),
        repeat=True,
    )
    decode: tuple[str, ...] = _f(
        (), "PD: a decode worker; repeat the flag for more", metavar="URL", repeat=1
    )
    prefill_policy: str | None = _f(
        None,
        "PD: the policy that picks the prefill worker (default: --policy); the prefix-aware "
        "ones pay off here, where prompts are computed and cached",
        choices=policy_names(),
    )
    decode_policy: str = _f(
        "least_load", "PD: the policy that picks the decode worker", choices=policy_names()
    )
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
    port: int = _f(30000, "port to listen on", ge=0, le=65535)
    cache_policy: CachePolicyConfig = field(
        default_factory=CachePolicyConfig,
        metadata={"help": "cache_aware / kv_aware settings (their fields are the flags)"},
    )
    kv_index: str = _f(
        "memory",
        "kv_aware: where the precise prefix index lives: memory (the router subscribes to the "
        "workers' KV events), redis://host:port/db (shared; `radixserve kv-indexer` writes it), "
        "or mooncake://HOST:PORT (Mooncake master's metrics port: the store's holdings, asked "
        "per request, on top of the workers' KV events)",
    )
    kvs_backend: str | None = _f(
        None,
        "Llumnix's name for the KV metadata service's kind: mooncake or redis (must agree with "
        "--kv-index's scheme)",
        choices=("mooncake", "redis"),
    )
    kvs_hash_algo: str = _f(
        "sha256_cbor",
        "kv_aware on Mooncake: hash of the store's chunk keys, as the engines write them "
        "(sha256_hex = sha256, xxhash = xxhash64); seed from the GO_HASH_SEED environment "
        "variable (default 0)",
        choices=("sha256_cbor", "sha256_hex", "sha256", "xxhash", "xxhash64"),
    )
    kvs_chunk_size: int = _f(
        256, "kv_aware on Mooncake: tokens per store key, as the engines'", ge=1
    )
    kvs_enable_save_unfull_chunk: bool = _f(
        False, "kv_aware on Mooncake: the engines also store a prompt's trailing partial chunk"
    )
    kvs_retry_times: int = _f(
        5,
        "kv_aware on Redis or Mooncake: retries of a failed lookup before the service is "
        "marked down",
        ge=0,
    )
    kvs_retry_interval_ms: float = _f(
        100.0, "kv_aware on Redis or Mooncake: wait between lookup retries", ge=0
    )
    kvs_metadata_service_down_duration_s: float = _f(
        30.0,
        "kv_aware on Redis or Mooncake: seconds a down service is left alone (routing falls "
        "back to the workers' events and the approximate tree) before it is tried again",
        ge=0,
    )
    kvs_timeout_ms: float = _f(
        500.0,
        "kv_aware on Redis or Mooncake: a lookup slower than this failed (keep it above the "
        "router's own p99 latency: a saturated router reads replies late)",
        gt=0,
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
    tokenize_workers: int = _f(
        TOKENIZE_WORKERS,
        "kv_aware: threads that tokenize long prompts off the event loop (HF tokenizers "
        "releases the GIL while it encodes), so that no prompt stalls other requests; default: "
        "one less than the CPUs, 1 to 4 (the event loop keeps a core); 0: on the event loop",
        ge=0,
        le=256,
    )
    api_key: str | None = _f(
        None,
        "bearer key required on inference endpoints (on /v1/messages also as x-api-key, "
        "as Anthropic's clients send it)",
    )
    admin_api_key: str | None = _f(
        None,
        "bearer key required on worker management; without one, management is answered to "
        "loopback clients only (an --api-key never grants it)",
    )
    worker_api_key: str | None = _f(
        None, "bearer key sent to workers (default: forward the client's Authorization)"
    )
    max_payload_size: int = _f(
        32 * 2**20, "largest request body in bytes, as `serve`'s (larger: 413)", ge=1
    )
    max_url_size: int = _f(8192, "longest request URL in bytes (longer: 414; nginx: 8 KiB)", ge=1)
    max_header_size: int = _f(
        16384, "largest request head (header lines) in bytes (larger: 431; uvicorn: 16 KiB)", ge=1
    )
    header_timeout_secs: float = _f(
        30.0, "a request head must arrive within this (else 408; nginx: 60 s)", gt=0
    )
    body_timeout_secs: float = _f(
        30.0, "longest pause between pieces of a request body (else 408; nginx: 60 s)", gt=0
    )
    keep_alive_timeout_secs: float = _f(
        75.0, "an idle keep-alive client connection is closed after this (nginx: 75 s)", gt=0
    )
    max_connections: int = _f(
        4096, "client connections at once; more are answered 503 and closed", ge=1
    )
    stream_timeout_secs: float = _f(
        300.0, "longest a worker may send nothing while answering (nginx: 60 s)", gt=0
    )
    max_concurrent_requests: int = _f(
        2048, "inference requests in flight at once (0: no cap); more wait in the queue", ge=0
    )
    queue_size: int = _f(
        1024, "requests that may wait for a slot; more are answered 503 with Retry-After", ge=0
    )
    queue_timeout_secs: float = _f(
        60.0, "longest wait in the queue (then 503 with Retry-After)", gt=0
    )
    session_header: str = _f(
        "X-Session-Id", "consistent_hashing: the request header that names the session"
    )
    request_timeout_secs: float = _f(1800.0, "longest a worker may take over one request", gt=0)
    max_retries: int = _f(
        3,
        "attempts on other workers after a connect error, 502, 503 or 504 (jittered backoff)",
        ge=0,
    )
    retry_backoff_ms: float = _f(
        10.0, "wait before the first retry; doubles for each next one", ge=0
    )
    retry_max_backoff_ms: float = _f(1000.0, "longest wait between retries", ge=0)
    health: HealthConfig = field(
        default_factory=HealthConfig,
        metadata={"help": "health checks, circuit breaker, worker connections"},
    )
    discovery: DiscoveryConfig = field(
        default_factory=DiscoveryConfig,
        metadata={"help": "Kubernetes pod discovery: --service-discovery, --selector"},
    )
    log_level: str = _f("info", "logging level", choices=("debug", "info", "warning", "error"))
    trace: TraceConfig = field(
        default_factory=TraceConfig,
        metadata={"help": "OpenTelemetry traces: --enable-trace, --otlp-traces-endpoint"},
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}")
        if self.retry_max_backoff_ms < self.retry_backoff_ms:
            raise ValueError("retry_max_backoff_ms must be >= retry_backoff_ms")
        if self.max_retries < 0 or self.max_payload_size <= 0 or self.request_timeout_secs <= 0:
            raise ValueError("max_retries >= 0, max_payload_size > 0, request_timeout_secs > 0")
        limits = (self.max_url_size, self.max_header_size, self.max_connections)
        timeouts = (self.header_timeout_secs, self.body_timeout_secs,
                    self.keep_alive_timeout_secs, self.stream_timeout_secs)  # fmt: skip
        caps = (self.max_concurrent_requests, self.queue_size)
        if min(limits) < 1 or min(timeouts) <= 0 or min(caps) < 0 or self.queue_timeout_secs <= 0:
            raise ValueError("size limits, connection caps and timeouts must be positive")
        self._check_pd()
        self._check_kv_index()
        # argparse hands over a list; keep the frozen config hashable and immutable.
        object.__setattr__(self, "worker_urls", tuple(self.worker_urls))
        if self.worker_type not in WORKER_TYPES:
            raise ValueError(
                f"--worker-type must be one of {', '.join(WORKER_TYPES)}, not {self.worker_type!r}"
            )
        object.__setattr__(self, "worker_kv_events", tuple(self.worker_kv_events))
        self.kv_event_overrides()  # a malformed entry is a one-line error now

    def _only_for(self, names: tuple[str, ...], where: str) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        set_ = [n for n in names if getattr(self, n) != defaults[n]]
        if set_:
            flags = ", ".join("--" + n.replace("_", "-") for n in set_)
            raise ValueError(f"{flags}: for --kv-index {where} only")

    def _check_pd(self) -> None:
        """--prefill and --decode as ((url, bootstrap port or None), ...) and (url, ...); with
        --pd-disaggregation, --policy becomes the prefill workers' (--prefill-policy)."""
        prefill = tuple(prefill_entry(e) for e in self.prefill or ())
        decode = tuple(decode_entry(e) for e in self.decode or ())
        object.__setattr__(self, "prefill", prefill)
        object.__setattr__(self, "decode", decode)
        if not self.pd_disaggregation:
            pd = ("prefill", "decode", "prefill_policy", "decode_policy")
            defaults = {f.name: f.default for f in fields(self)}
            set_ = ["--" + n.replace("_", "-") for n in pd if getattr(self, n) != defaults[n]]
            if set_:
                raise ValueError(f"{', '.join(set_)}: for --pd-disaggregation only")
            return
        if self.discovery.service_discovery:
            raise ValueError("--service-discovery: not with --pd-disaggregation yet (smg's "
                             "--prefill-selector / --decode-selector are not built)")  # fmt: skip
        if self.worker_urls:
            raise ValueError("--worker-urls: with --pd-disaggregation give the workers as "
                             "--prefill URL [BOOTSTRAP_PORT] and --decode URL")  # fmt: skip
        if self.prefill_policy is not None:
            object.__setattr__(self, "policy", self.prefill_policy)
        if self.decode_policy not in POLICIES or self.decode_policy == "kv_aware":
            raise ValueError(f"--decode-policy {self.decode_policy}: a decode worker holds no "
                             "prefix the router could look up; choose a load policy")  # fmt: skip

    def _check_kv_index(self) -> None:
        remote = ("kvs_retry_times", "kvs_retry_interval_ms", "kvs_timeout_ms",
                  "kvs_metadata_service_down_duration_s")  # fmt: skip
        mooncake = ("kvs_hash_algo", "kvs_chunk_size", "kvs_enable_save_unfull_chunk")
        if self.kv_index == "memory":
            self._only_for((*remote, "redis_prefix"), "redis://... or mooncake://...")
            self._only_for(mooncake + ("kvs_backend",), "mooncake://...")
            return
        if self.kv_index.startswith("mooncake://"):
            self._check_mooncake()
        elif not self.kv_index.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"--kv-index must be memory, a redis:// URL or mooncake://HOST:PORT, "
                f"not {self.kv_index!r}"
            )
        else:
            self._only_for(mooncake, "mooncake://...")
            if self.kvs_backend not in (None, "redis"):
                raise ValueError(f"--kvs-backend {self.kvs_backend} disagrees with --kv-index "
                                 f"{self.kv_index}")  # fmt: skip
        if self.policy != "kv_aware":
            raise ValueError(f"--kv-index {self.kv_index} is read by --policy kv_aware only")
        if (
            not self.kv_index.startswith("mooncake://")
            and importlib.util.find_spec("redis") is None
        ):
            raise ValueError(
                "--kv-index redis://... needs redis-py: pip install 'radixserve[redis]'"
            )
        if self.kvs_retry_times < 0 or self.kvs_retry_interval_ms < 0 or self.kvs_timeout_ms <= 0:
            raise ValueError("kvs_retry_times, kvs_retry_interval_ms >= 0; kvs_timeout_ms > 0")
        if self.kvs_metadata_service_down_duration_s < 0:
            raise ValueError("kvs_metadata_service_down_duration_s must be >= 0")

    def _check_mooncake(self) -> None:
        host, sep, port = self.kv_index.removeprefix("mooncake://").rstrip("/").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--kv-index {self.kv_index}: expected mooncake://HOST:PORT (the "
                             "master's metrics port)")  # fmt: skip
        if self.kvs_backend not in (None, "mooncake"):
            raise ValueError(f"--kvs-backend {self.kvs_backend} disagrees with --kv-index "
                             f"{self.kv_index}")  # fmt: skip
        if self.redis_prefix != "radixserve":
            raise ValueError("--redis-prefix: for --kv-index redis://... only")
        if self.kvs_chunk_size < 1:
            raise ValueError(f"--kvs-chunk-size must be >= 1, got {self.kvs_chunk_size}")

    def kv_event_overrides(self) -> dict[str, EventSource]:
        """--worker-kv-events as {worker url: publisher}."""
        return dict(parse_kv_events_flag(entry) for entry in self.worker_kv_events)

    @property
    def mooncake_address(self) -> str:
        """HOST:PORT of --kv-index mooncake://HOST:PORT."""
        return self.kv_index.removeprefix("mooncake://").rstrip("/")


DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's, for a --prefill given without one


def prefill_entry(entry: Any) -> tuple[str, int | None]:
    """One --prefill: URL, or [URL], or [URL, BOOTSTRAP_PORT] (a "none" port: the default)."""
    parts = [entry] if isinstance(entry, str) else list(entry)
    if not 1 <= len(parts) <= 2 or not isinstance(parts[0], str):
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(map(str, parts))}")
    if len(parts) == 1 or parts[1] in (None, "none"):
        return parts[0], None
    port = parts[1]
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"--prefill {parts[0]} {parts[1]}: the bootstrap port must be 1-65535")
    return parts[0], port


def decode_entry(entry: Any) -> str:
    """One --decode: URL (or [URL], as argparse gives it)."""
    parts = [entry] if isinstance(entry, str) else list(entry)
    if len(parts) != 1 or not isinstance(parts[0], str):
        raise ValueError(f"--decode takes one URL each, got {' '.join(map(str, parts))}")
    return parts[0]
