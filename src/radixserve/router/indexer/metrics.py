"""The kv-indexer's /metrics: Prometheus lines for its workers, subscribers and Redis writes."""

from __future__ import annotations

from typing import Any

PREFIX = "radixserve_kv_indexer_"


def metric_lines(indexer: Any) -> list[str]:
    """Everything an operator watches: blocks per worker, events and gaps per worker, batches
    written to Redis, write errors, whether Redis answers, and what is still queued."""
    writer, plane = indexer.writer, indexer.plane
    lines: list[str] = []
    blocks = writer.blocks()
    per_worker = {"blocks": ("gauge", {w: blocks.get(w, 0) for w in indexer.followed})}
    per_worker["worker_alive"] = (
        "gauge",
        {w: int(bool(f.alive)) for w, f in indexer.followed.items()},
    )
    for counter, values in plane.stat_totals().items():
        per_worker[f"{counter}_total"] = ("counter", values)
    for name, (kind, values) in per_worker.items():
        lines.append(f"# TYPE {PREFIX}{name} {kind}")
        lines += [f'{PREFIX}{name}{{worker="{w}"}} {v}' for w, v in values.items()]
    totals = {
        "redis_up": ("gauge", int(writer.redis_ok)),
        "batches_written_total": ("counter", writer.batches_written),
        "redis_write_errors_total": ("counter", writer.write_errors),
        "redis_rewrites_total": ("counter", writer.rewrites),
        "queued_batches": ("gauge", len(writer.ops)),
        "events_total": ("counter", writer.stats.events),
        "orphan_blocks_total": ("counter", writer.stats.orphans),
        "resyncs_total": ("counter", plane.resyncs),
    }
    for name, (kind, value) in totals.items():
        lines += [f"# TYPE {PREFIX}{name} {kind}", f"{PREFIX}{name} {value}"]
    return lines
