"""The fleet view's data: one snapshot of a running `radixserve route` and its workers, read from
the router (worker list, its /metrics) and from each worker's own /metrics (hit rate, queue, and
with KV events on, the blocks it holds)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx

# router gauges per worker; kv_index_blocks exists only where the router indexes KV events
ROUTER_GAUGES = ("tree_size_units", "kv_index_blocks")
# worker gauges and counters (radixserve serve's /metrics names)
WORKER_METRICS = {
    "radixserve_cache_hit_rate": "hit_rate",
    "radixserve_num_running_reqs": "running",
    "radixserve_num_queue_reqs": "waiting",
    "radixserve_token_usage": "kv_usage",
    "radixserve_prompt_tokens_total": "prompt_tokens",
    "radixserve_cached_tokens_total": "cached_tokens",
    "radixserve_kv_events_blocks": "kv_blocks",  # with --kv-events-config: blocks it holds
}
_SAMPLE = re.compile(r'^(\w+)(?:\{worker="([^"]*)"\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {name: {worker label or "": value}} (labels other than worker skipped)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            name, label, value = m.groups()
            try:
                out.setdefault(name, {})[label or ""] = float(value)
            except ValueError:
                continue
    return out


async def snapshot(client: httpx.AsyncClient, router_url: str) -> dict[str, Any]:
    """Every worker the router knows, with its load (router) and cache state (worker)."""
    base = router_url.rstrip("/")
    listing, metrics = await asyncio.gather(
        client.get(base + "/workers"), client.get(base + "/metrics")
    )
    listing.raise_for_status()
    router = parse_metrics(metrics.text) if metrics.status_code == 200 else {}
    workers = listing.json().get("workers", [])
    stats = await asyncio.gather(*(_worker_stats(client, w["url"]) for w in workers))
    rows = [_row(w, s, router) for w, s in zip(workers, stats)]
    hit = router.get("radixserve_router_expected_hit_rate", {}).get("")
    kv_events = "radixserve_router_kv_index_blocks" in router
    return {"router": base, "workers": rows, "expected_hit_rate": hit, "kv_events": kv_events}


async def _worker_stats(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The worker's own numbers, or None where it does not answer (it shows as unreachable)."""
    base = url.rstrip("/")
    try:
        resp, info = await asyncio.gather(
            client.get(base + "/metrics"), client.get(base + "/get_server_info")
        )
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    parsed = parse_metrics(resp.text)
    stats = {key: parsed[name][""] for name, key in WORKER_METRICS.items() if name in parsed}
    if not _publishes_kv_events(info):  # the gauge is there, at 0, on every worker
        stats.pop("kv_blocks", None)
    return stats


def _publishes_kv_events(info: httpx.Response) -> bool:
    try:
        return info.status_code == 200 and info.json().get("kv_events") is not None
    except ValueError:
        return False


def _row(w: dict[str, Any], stats: dict[str, float] | None, router: dict) -> dict[str, Any]:
    row = {k: w.get(k) for k in ("id", "url", "healthy", "circuit", "load", "requests", "errors")}
    for gauge in ROUTER_GAUGES:
        samples = router.get("radixserve_router_" + gauge, {})
        value = samples.get(str(w.get("id")), samples.get(w.get("url", "")))
        row[gauge] = value
    row["reachable"] = stats is not None
    row.update(stats or {})
    return row
