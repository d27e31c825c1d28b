"""Decision cost of kv_aware on Mooncake's metadata service (`route --kv-index mooncake://`)
against kv_aware on its in-memory index and on Redis, and cache_aware.

    python benchmarks/kv_mooncake_bench.py            # a few minutes on a busy 2-core VM
    python benchmarks/kv_mooncake_bench.py --quick    # a fifth of the decisions

In process, per decision: parse the request, look it up (Redis: one EVALSHA round trip to a local
redis-server; Mooncake: the prompt's store keys hashed from its token ids and ONE batch query to
a local mooncake_master, in bounded requests when the keys pass 16 KiB of URL), select, dispatch
hooks. p50/p99 per decision at 2,000- and 8,000-token prompts (GROUPS groups, each prefix held by
one of 4 workers; on Mooncake every prefix is in the store process's segment, written as
placeholders under the real keys), chunks of 256 tokens (Llumnix's --kvs-chunk-size default) and
of 16 (one page: 125 / 500 keys). The ratio is each p50 over kv_aware memory's in the same run,
decisions interleaved so that a neighbour's burst hits all alike. Timings never fail anything;
needs the mooncake extra (+ libibverbs1) and Debian's redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _machine import machine_line
from kv_redis_bench import (
    GROUPS,
    WORKERS,
    filled_indexes,
    group_prefix,
    payload,
    pct,
)
from mooncake_harness import MooncakeCluster, backend_ports, pin_this_process
from radixserve.cache.hashing import KVNamespace
from radixserve.kvstore.backends import create_backend
from radixserve.kvstore.storage import PageFormat
from radixserve.router.kvindex.mooncake_meta import store_keys
from radixserve.router.kvindex.mooncake_reader import MooncakeIndexConfig, MooncakeStoreReader
from radixserve.router.policies.cache_aware import CacheAwarePolicy
from radixserve.router.policies.kv_aware import KvAwarePolicy
from radixserve.router.proxy.kvs_transport import PooledMaster
from radixserve.router.proxy.request_body import request_view
from redis_harness import RedisServer

NS = KVNamespace("bench-model", "bfloat16", 30, 3, 64, 16).digest()


def write_store(cluster: MooncakeCluster, length: int, chunks: tuple[int, ...]) -> None:
    """Every group's prefix, as 64-byte placeholders under its store keys at each chunk size."""
    cfg = {"master_server_address": cluster.master_rpc, **backend_ports(pin_this_process())}
    backend = create_backend("mooncake", PageFormat(NS, 64), cfg)
    try:
        for chunk in chunks:
            for g in range(GROUPS):
                keys = store_keys(group_prefix(g, length), NS, chunk)
                assert backend.put_pages(keys, [bytes(64)] * len(keys)) == len(keys)
    finally:
        backend.close()


async def decisions(
    redis_url: str, metrics_addr: str, length: int, n: int, chunks: tuple[int, ...]
):
    ids, views, memory, redis = await filled_indexes(redis_url, length)
    targets: dict[str, tuple[KvAwarePolicy | CacheAwarePolicy, object]] = {
        "kv_aware memory": (KvAwarePolicy(index=memory), None),
        "kv_aware redis": (KvAwarePolicy(index=redis), redis),
    }
    readers = []
    for chunk in chunks:
        # with the router's own transport to the master, as `route` builds it
        mc = MooncakeIndexConfig(metrics_addr, chunk_size=chunk)
        reader = MooncakeStoreReader(mc, PooledMaster(metrics_addr, mc.timeout_ms / 1000))
        for w in ids:
            reader.register(w, {"kv_store": {"namespace": NS, "segment": None}})
        readers.append(reader)
        # as `route --kv-index mooncake://` builds it: device holdings from the event index
        policy = KvAwarePolicy(index=memory, lower=(reader,))
        targets[f"kv_aware mooncake/{chunk}"] = (policy, reader)
    targets["cache_aware"] = (CacheAwarePolicy(), None)
    bodies = [json.dumps(payload(i % GROUPS, i, length)).encode() for i in range(n)]
    times: dict[str, list[float]] = {t: [] for t in targets}
    loaded = dict.fromkeys(targets, 0)
    for i, body in enumerate(bodies):
        for name, (policy, reader) in targets.items():
            t0 = time.perf_counter()
            view = request_view(json.loads(body))
            if reader is not None:
                await reader.prepare(view.token_ids, view.kv_namespace)
            pick = policy.select(views, view, float(i))
            policy.on_dispatch(views[pick].id, view, float(i))
            policy.on_complete(views[pick].id, view, float(i))
            times[name].append(time.perf_counter() - t0)
            if isinstance(reader, MooncakeStoreReader):
                loaded[name] += max(reader.answer.values(), default=0) if reader.answer else 0
    for reader in readers:
        assert reader.client.stats.fallbacks == 0, "the master did not answer every lookup"
        await reader.close()
    await redis.close()
    return times, loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a fifth of the decisions")
    ap.add_argument("--decisions", type=int, default=400)
    args = ap.parse_args()
    n = args.decisions // 5 if args.quick else args.decisions
    chunks = (256, 16)
    print(machine_line())
    print(f"workload: {GROUPS} prefix groups on {WORKERS} workers, token-id prompts, {n} "
          "decisions per target and length, interleaved")  # fmt: skip
    redis, cluster = RedisServer(), MooncakeCluster(segment_bytes=512 << 20)
    try:
        print(f"{'target':<24}{'tokens':>8}{'p50 us':>10}{'p99 us':>10}{'p50 vs memory':>16}"
              f"{'store hit/prompt':>18}")  # fmt: skip
        for length in (2000, 8000):
            write_store(cluster, length, chunks)
            times, loaded = asyncio.run(
                decisions(redis.url, cluster.metrics_addr, length, n, chunks)
            )
            base = statistics.median(times["kv_aware memory"])
            for name, xs in times.items():
                p50 = statistics.median(xs)
                hit = f"{loaded[name] / n / length:>17.2f}" if loaded[name] else f"{'':>17}"
                print(f"{name:<24}{length:>8}{p50 * 1e6:>10.0f}{pct(xs, 0.99):>10.0f}"
                      f"{p50 / base:>15.2f}x {hit}", flush=True)  # fmt: skip
    finally:
        cluster.stop()
        redis.stop()


if __name__ == "__main__":
    main()
