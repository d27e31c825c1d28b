"""The router's Prometheus metrics, rendered by prometheus-client from the router's own counters
at scrape time (no second set of counters to keep in step on the request path), kv_aware's
index and event counters and the shared Redis index's (kvs_*) among them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from radixserve.router.proxy.worker_kinds import kind_families

if TYPE_CHECKING:
    from radixserve.router.policies.base import RouterPolicy
    from radixserve.router.proxy.admission import Admission
    from radixserve.router.proxy.kv_setup import KvRouting
    from radixserve.router.proxy.worker_kinds import WorkerKinds
    from radixserve.router.proxy.workers import WorkerRegistry


class Router(Protocol):
    """What the collector reads of the router (app.Router) at scrape time."""

    registry: WorkerRegistry
    policy: RouterPolicy
    admission: Admission
    kv: KvRouting | None
    kvs: Any
    kinds: WorkerKinds
    retries: int
    failed: dict[int, int]
    decisions: list[int]
    decision_sum: float
    connections: int


PREFIX = "radixserve_router_"
BUCKETS = (2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


class _Collector:
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        r, now = self.router, time.monotonic()
        ws = r.registry.workers
        sizes = r.policy.tree_size()
        per_worker = [
            ("requests", CounterMetricFamily, "requests sent", lambda w: w.counts["requests"]),
            ("errors", CounterMetricFamily, "failed attempts", lambda w: w.counts["errors"]),
            ("worker_load", GaugeMetricFamily, "requests in flight", lambda w: w.load),
            ("worker_healthy", GaugeMetricFamily, "1 if routable", lambda w: w.view(now).healthy),
            ("tree_size_units", GaugeMetricFamily, "prefix tree size",
             lambda w: sizes.get(w.id, 0)),
        ]  # fmt: skip
        for name, kind, doc, value in per_worker:
            family = kind(PREFIX + name, doc, labels=["worker"])
            for w in ws:
                family.add_metric([w.url], float(value(w)))
            yield family
        yield CounterMetricFamily(PREFIX + "retries", "retried attempts", value=r.retries)
        hit_rate = r.policy.expected_hit_rate()
        yield GaugeMetricFamily(PREFIX + "expected_hit_rate", "expected prefix hits", hit_rate)
        yield GaugeMetricFamily(PREFIX + "connections", "open client connections", r.connections)
        yield GaugeMetricFamily(PREFIX + "queued_requests", "waiting for a slot",
                                r.admission.queued)  # fmt: skip
        yield GaugeMetricFamily(PREFIX + "active_requests", "holding a slot", r.admission.active)
        failed = CounterMetricFamily(PREFIX + "failed_requests", "answered errors", labels=["code"])
        for code, n in sorted(r.failed.items()):
            failed.add_metric([str(code)], n)
        yield failed
        yield _histogram(r.decisions, r.decision_sum)
        if r.kv is not None:
            yield from _kv_families(r.kv.metric_families(), {w.id: w.url for w in ws})
        if r.kvs is not None:
            yield from _kvs_families(r.kvs)
        yield from kind_families(r.kinds, ws, r.kv.plane.subscribers if r.kv else {})


def _histogram(counts: list[int], total: float) -> Metric:
    buckets, running = [], 0
    for bound, n in zip([*map(str, BUCKETS), "+Inf"], counts):
        running += n
        buckets.append((bound, running))
    return HistogramMetricFamily(
        PREFIX + "decision_seconds", "routing decision time", buckets=buckets, sum_value=total
    )


_KINDS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


def _kv_families(
    families: list[tuple[str, str, dict[Any, object]]], urls: dict[str, str]
) -> Iterator[Metric]:
    """kv_aware's families, {worker id: value} or {(worker id, medium): value} each; "" is the
    key of an unlabelled value. Workers are labelled by URL, as the router's other per-worker
    families."""
    for name, kind, samples in families:
        doc = "kv_aware: " + name.removesuffix("_total").replace("_", " ")
        if set(samples) == {""}:
            yield _KINDS[kind](PREFIX + name, doc, value=float(samples[""]))  # type: ignore[arg-type]
            continue
        by_medium = name == "kv_index_lower_blocks"
        family = _KINDS[kind](
            PREFIX + name, doc, labels=["worker", "medium"] if by_medium else ["worker"]
        )
        for key, value in samples.items():
            wid, *medium = key if by_medium else (key,)
            family.add_metric([urls.get(wid, str(wid)), *medium], float(value))  # type: ignore[arg-type]
        yield family


def _kvs_families(kvs: Any) -> Iterator[Metric]:
    """The KV metadata service's gating state and counts (kvindex.redis_reader.RedisIndexReader,
    or kvindex.mooncake_reader.MooncakeStoreReader)."""
    for name, kind, doc, value in kvs.metric_samples():
        yield _KINDS[kind](PREFIX + name, doc, value=float(value))
    yield SummaryMetricFamily(
        PREFIX + "kvs_lookup_seconds", "time spent in answered lookups",
        count_value=kvs.lookups, sum_value=kvs.lookup_seconds,
    )  # fmt: skip


def metrics_registry(router: Router) -> CollectorRegistry:
    """A registry of its own per router (several may live in one test process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(router))
    return registry
