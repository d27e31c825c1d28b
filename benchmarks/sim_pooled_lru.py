"""Is cache-aware routing losing hits to the split of the KV cache over engines? On the Mooncake
trace, N simulated engines of K KV tokens behind `cache_aware` against the strongest baseline
that ignores load: one pooled LRU cache of N x K tokens fed the prompts in arrival order (no
engine, no queue), plus N LRU caches of K tokens with requests sharded by their first block.

    python benchmarks/sim_pooled_lru.py [--engines 4 8 16] [--block-tokens 512]

Preset llama3-8b-h100, K = its default pool (414,581 tokens; scaled with --block-tokens).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from _machine import machine_line
from radixserve.cache.radix import RadixCache
from radixserve.config import CacheConfig
from radixserve.sim.cluster import ClusterConfig, simulate
from radixserve.sim.costmodel import get_cost_model
from radixserve.sim.workloads import TraceConfig, WorkloadRequest, trace_replay

TRACE = Path(__file__).parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"


def lru_hit_rate(
    reqs: list[WorkloadRequest], caches: int, size: int, shard: Callable[[WorkloadRequest], int]
) -> float:
    """Prompt tokens hit by LRU radix caches of ``size`` tokens, prompts inserted on arrival."""
    trees = [RadixCache(CacheConfig(max_total_tokens=size)) for _ in range(caches)]
    hit = total = 0
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        tree, ids = trees[shard(r) % caches], r.input_ids
        matched = tree.match_prefix(ids).length
        hit += min(matched, len(ids) - 1)  # an engine computes a prompt's last token
        total += len(ids)
        over = tree.evictable_size() + len(ids) - matched - size
        if over > 0:
            tree.evict(over)
        tree.insert(ids, range(len(ids)))  # type: ignore[arg-type]
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--block-tokens", type=int, default=512)
    args = ap.parse_args()
    print(machine_line())
    reqs = trace_replay(TraceConfig(path=str(TRACE), block_tokens=args.block_tokens))
    kv = get_cost_model("llama3-8b-h100").kv_capacity_tokens * args.block_tokens // 512
    print(f"workload: Mooncake trace, {len(reqs):,} requests, {args.block_tokens} tokens a block")
    for n in args.engines:
        pooled = lru_hit_rate(reqs, 1, n * kv, lambda r: 0)
        sharded = lru_hit_rate(reqs, n, kv, lambda r: r.hash_ids[0])
        res = simulate(
            reqs, ClusterConfig(engines=n), cache_config=CacheConfig(max_total_tokens=kv)
        )
        print(
            f"{n:>2} x {kv:,} KV tokens: pooled LRU {pooled:.1%}, sharded LRU {sharded:.1%}, "
            f"cache_aware {res.hit_rate:.1%} (x{res.hit_rate / pooled:.2f} of pooled), busiest "
            f"engine {res.imbalance()['busy_s']:.2f}x the mean busy time"
        )


if __name__ == "__main__":
    main()
