"""The kv-indexer's /metrics, rendered by prometheus-client from the indexer's own counters at
scrape time, as the router's are (proxy/metrics.py): blocks per worker, events and gaps per
worker, batches written to Redis, write errors, whether Redis answers, what is still queued."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from radixserve.router.indexer.service import Indexer

PREFIX = "radixserve_kv_indexer_"


class _Collector:
    def __init__(self, indexer: Indexer) -> None:
        self.indexer = indexer

    def collect(self) -> Iterator[Metric]:
        indexer = self.indexer
        writer, plane, followed = indexer.writer, indexer.plane, indexer.followed
        blocks = writer.blocks()
        per_worker: list[tuple[str, type, str, dict[object, float]]] = [
            ("blocks", GaugeMetricFamily, "blocks indexed", {w: blocks.get(w, 0) for w in followed}),
            ("worker_alive", GaugeMetricFamily, "1 if the worker passes its health checks",
             {w: int(bool(f.alive)) for w, f in followed.items()}),
        ]  # fmt: skip
        for counter, values in plane.stat_totals().items():
            doc = "subscriber: " + counter
            per_worker.append((counter, CounterMetricFamily, doc, values))  # type: ignore[arg-type]
        for name, kind, doc, values in per_worker:
            family = kind(PREFIX + name, doc, labels=["worker"])
            for worker, value in values.items():
                family.add_metric([str(worker)], float(value))
            yield family
        totals = [
            ("redis_up", GaugeMetricFamily, "1 if the last write reached Redis", writer.redis_ok),
            ("batches_written", CounterMetricFamily, "event batches written to Redis",
             writer.batches_written),
            ("redis_write_errors", CounterMetricFamily, "failed Redis writes", writer.write_errors),
            ("redis_rewrites", CounterMetricFamily, "workers rewritten in full", writer.rewrites),
            ("queued_batches", GaugeMetricFamily, "batches waiting to be written", len(writer.ops)),
            ("index_events", CounterMetricFamily, "events applied to the index",
             writer.stats.events),
            ("orphan_blocks", CounterMetricFamily, "blocks stored without a known parent",
             writer.stats.orphans),
            ("snapshot_resyncs", CounterMetricFamily, "workers resynchronised from a snapshot",
             plane.resyncs),
        ]  # fmt: skip
        for name, kind, doc, value in totals:
            yield kind(PREFIX + name, doc, value=float(value))


def metrics_registry(indexer: Indexer) -> CollectorRegistry:
    """A registry of its own per indexer (several may live in one test process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(indexer))
    return registry
