"""What any router could reach on the Mooncake trace: one LRU cache of the whole fleet's KV.

A reference for the kv_aware sweep (kv_aware_sweep.py; issue 12, acceptance 4). Routing decides
which engine's pool a prompt lands in; it cannot make the fleet hold more than its pools do.
This script replays the committed Mooncake trace, in trace order, through a single LRU cache of
prefix blocks sized to the fleet's total KV (engines x the per-engine pool at each fraction of
the preset's default), with no routing at all: every request sees every block any earlier
request left, as if the eight pools were one. A prompt hits its leading blocks that are still
cached (Mooncake's traces name a prompt by one hash id per 512-token block, and two prompts
share a block only if they share every block before it), then all its blocks become the most
recently used, and the least recently used go until the cache fits.

    python benchmarks/kv_pooled_reference.py [--fractions 1 0.5 ...] [--subsample 0 1 2 3]

`--subsample` drops the same seeded 10% of the requests as the sweep's, so each row lines up
with a row of the sweep's table. Deterministic; about a minute and a half on 2 cores, most
of it building the trace's prompts.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_line  # noqa: E402
from kv_aware_sweep import FRACTIONS, PRESET, TRACE, requests  # noqa: E402
from radixserve.sim.costmodel import get_cost_model  # noqa: E402
from radixserve.sim.trace_tokens import TRACE_BLOCK_TOKENS  # noqa: E402
from radixserve.sim.workloads import WorkloadRequest  # noqa: E402


def pooled_lru_hit_rate(reqs: list[WorkloadRequest], capacity_tokens: int) -> float:
    """Share of prompt tokens one LRU cache of `capacity_tokens` hits, requests in order."""
    capacity = capacity_tokens // TRACE_BLOCK_TOKENS
    cache: OrderedDict[tuple, None] = OrderedDict()
    hit = total = 0
    for r in reqs:
        prefix: tuple = ()
        keys = []
        for block in r.hash_ids:
            prefix = (prefix, block)  # a block is its whole chain of ids
            keys.append(prefix)
        held = 0
        for key in keys:
            if key not in cache:
                break
            held += 1
        hit += min(held * TRACE_BLOCK_TOKENS, len(r.input_ids))
        total += len(r.input_ids)
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hit / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    parser.add_argument("--subsample", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--engines", type=int, default=8)
    args = parser.parse_args()
    pool = get_cost_model(PRESET).kv_capacity_tokens
    print(machine_line())
    print(f"trace: {TRACE.name}; fleet: {args.engines} x {PRESET}, pooled into one LRU cache")
    print(f"{'KV/engine':>10} {'fleet KV':>11} {'drop':>4}  {'pooled LRU hit':>14}")
    for fraction in args.fractions:
        per_engine = int(pool * fraction)
        for seed in args.subsample:
            reqs = requests("mooncake", None, seed)
            rate = pooled_lru_hit_rate(reqs, per_engine * args.engines)
            drop = f"s{seed}" if seed else "-"
            print(f"{per_engine:>10,} {per_engine * args.engines:>11,} {drop:>4}  {rate:14.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
