"""Prometheus metrics of one server: engine gauges read from the scheduler's stats at scrape
time, and token counters and latency histograms measured here, where the client's clock runs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixserve.engine.messages import TextOut

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# scheduler stats field -> (metric suffix, help); names follow SGLang's (sglang:num_queue_reqs...)
ENGINE_GAUGES = {
    "num_running": ("num_running_reqs", "requests running in the engine"),
    "num_waiting": ("num_queue_reqs", "requests waiting in the engine's queue"),
    "kv_usage": ("token_usage", "share of the KV pool held by requests or locked in the cache"),
    "cache_hit_rate": ("cache_hit_rate", "cached prompt tokens / prompt tokens, since start"),
    "num_retracted": ("num_retracted_reqs", "requests retracted for KV since start"),
    # counts since start: steps run, and their wall time, whole and inside the runner
    "engine_steps": ("engine_steps", "engine steps that ran a batch, since start"),
    "engine_step_seconds": (
        "engine_step_seconds",
        "wall seconds of those steps: scheduling, the runner, outputs sent",
    ),
    "engine_runner_seconds": (
        "engine_runner_seconds",
        "of engine_step_seconds, inside the runner: forward, logits, sampling",
    ),
    # with --enable-hierarchical-cache only
    "host_tier_tokens": ("hicache_host_used_tokens", "host-tier KV slots holding KV"),
    "host_tier_total": ("hicache_host_total_tokens", "host-tier KV slots"),
    # with --hicache-storage-backend only (counts since start, but storage_up)
    "storage_up": ("hicache_storage_up", "1 while the storage tier's backend is reachable"),
    "storage_prefetch_lookups": ("hicache_storage_prefetch_lookups", "storage prefetches started"),
    "storage_prefetch_waits": (
        "hicache_storage_prefetch_waits",
        "requests held while their storage prefetch ran",
    ),
    "storage_prefetch_timeouts": (
        "hicache_storage_prefetch_timeouts",
        "held requests queued at their prefetch deadline",
    ),
    "storage_prefetch_failures": (
        "hicache_storage_prefetch_failures",
        "storage prefetches that loaded fewer pages than the store listed (the rest recomputed)",
    ),
    "storage_prefetch_tokens": (
        "hicache_storage_prefetch_tokens",
        "tokens prefetched from storage into the host tier",
    ),
    "storage_prefetch_skipped_pages": (
        "hicache_storage_prefetch_skipped_pages",
        "pages a prefetch did not read: beyond the room the host tier could make for them",
    ),
    "storage_prefetch_unlanded_pages": (
        "hicache_storage_prefetch_unlanded_pages",
        "pages read from storage but not landed: the host tier's room was gone when they came",
    ),
    "storage_bytes_read": ("hicache_storage_bytes_read", "KV bytes read from the storage tier"),
    "storage_bytes_written": (
        "hicache_storage_bytes_written",
        "KV bytes written to the storage tier",
    ),
    "storage_pages_written": ("hicache_storage_pages_written", "pages written to storage"),
    "storage_pages_gathered": (
        "hicache_storage_pages_gathered",
        "pages read from the device pool by the storage writer (only those the store lacked)",
    ),
    "storage_write_pinned_tokens": (
        "hicache_storage_write_pinned_tokens",
        "device tokens kept from eviction until the storage writer has read them",
    ),
    "storage_write_dropped_pages": (
        "hicache_storage_write_dropped_pages",
        "pages not written: the writer's queue was full",
    ),
    "storage_refused_pages": (
        "hicache_storage_refused_pages",
        "stored values refused (another namespace, size, key or checksum): never loaded",
    ),
    "storage_cached_tokens": (
        "hicache_storage_cached_tokens",
        "prompt tokens served from pages the store gave",
    ),
    # with --kv-events-config only
    "kv_events_blocks": ("kv_events_blocks", "full blocks announced and not removed"),
    "kv_events_sent": ("kv_events_sent", "KV events published since start"),
    "kv_events_seq": ("kv_events_seq", "sequence number of the last KV-event batch"),
    "kv_events_dropped_batches": (
        "kv_events_dropped_batches",
        "KV-event batches dropped on a full publisher queue",
    ),
}


def stats_dict(stats: Any) -> dict[str, Any]:
    """The scheduler's stats as a plain dict, whether it sent a dataclass or a mapping."""
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        return dataclasses.asdict(stats)
    return dict(stats) if isinstance(stats, Mapping) else {}


class ServerMetrics:
    """One registry per server (no process-wide globals), rendered by ``/metrics``."""

    def __init__(self, prefix: str = "radixserve_") -> None:
        r = self.registry = CollectorRegistry()
        p = prefix
        self.engine = {
            key: Gauge(p + name, help, registry=r) for key, (name, help) in ENGINE_GAUGES.items()
        }
        self.up = Gauge(p + "engine_up", "1 while every engine process is alive", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens processed", registry=r)
        self.cached_tokens = Counter(
            p + "cached_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.cached_tokens_by_tier = Counter(
            p + "cached_tokens_by_tier",
            "prompt tokens served from the prefix cache, by the KV tier they were in "
            "(device: the engine's pool; host: loaded back from host memory; storage: loaded "
            "from the KV store)",
            ["tier"],
            registry=r,
        )
        self.generation_tokens = Counter(
            p + "generation_tokens", "tokens generated and sent", registry=r
        )
        self.requests = Counter(
            p + "requests", "finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time to first token",
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between output tokens",
                             buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "request latency, end to end",
                             buckets=E2E_BUCKETS, registry=r)  # fmt: skip

    def track(self, start: float | None = None) -> RequestTrack:
        return RequestTrack(self, time.perf_counter() if start is None else start)

    def set_engine(self, stats: Mapping[str, Any] | None) -> None:
        """Engine gauges from a stats dict; None means the engine is down."""
        self.up.set(0 if stats is None else 1)
        for key, gauge in self.engine.items():
            value = (stats or {}).get(key)
            if isinstance(value, int | float):
                gauge.set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTrack:
    """Latency and token accounting of one generation, fed with each TextOut it yields."""

    __slots__ = ("metrics", "start", "last", "ended")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics, self.start = metrics, start
        self.last: float | None = None
        self.ended = False

    def on_output(self, out: TextOut) -> None:
        now, n, m = time.perf_counter(), len(out.token_ids), self.metrics
        if n and self.last is None:
            m.ttft.observe(now - self.start)
            m.prompt_tokens.inc(out.prompt_tokens)
            m.cached_tokens.inc(out.cached_tokens)
            host, storage = out.host_cached_tokens, out.storage_cached_tokens
            m.cached_tokens_by_tier.labels("host").inc(host)
            m.cached_tokens_by_tier.labels("storage").inc(storage)
            m.cached_tokens_by_tier.labels("device").inc(out.cached_tokens - host - storage)
        elif n and self.last is not None:
            # one token per output today; should an output carry several, spread the gap
            for _ in range(n):
                m.itl.observe((now - self.last) / n)
        if n:
            self.last = now
            m.generation_tokens.inc(n)
        if out.finished:
            self.end(out.finish_reason or "stop")

    def end(self, reason: str) -> None:
        """Record the end once: finished, aborted by a disconnect, or failed."""
        if self.ended:
            return
        self.ended = True
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - self.start)
