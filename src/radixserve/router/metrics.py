"""The router's Prometheus metrics, rendered by prometheus-client from the router's own counters
at scrape time (no second set of counters to keep in step on the request path)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from radixserve.router.app import Router

PREFIX = "radixserve_router_"
BUCKETS = (2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


class _Collector:
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        r, now = self.router, time.monotonic()
        ws = r.registry.workers
        sizes = getattr(r.policy, "tree_size", dict)()
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
        hit_rate = getattr(r.policy, "expected_hit_rate", lambda: 0.0)()
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


def _histogram(counts: list[int], total: float) -> Metric:
    buckets, running = [], 0
    for bound, n in zip([*map(str, BUCKETS), "+Inf"], counts):
        running += n
        buckets.append((bound, running))
    return HistogramMetricFamily(
        PREFIX + "decision_seconds", "routing decision time", buckets=buckets, sum_value=total
    )


def metrics_registry(router: Router) -> CollectorRegistry:
    """A registry of its own per router (several may live in one test process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(router))
    return registry
