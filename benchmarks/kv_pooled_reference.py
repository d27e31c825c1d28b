"""What any router could reach on the Mooncake trace: one LRU cache of the whole fleet's KV.

A reference for the kv_aware sweep (kv_aware_sweep.py; issue 12, acceptance 4). Routing decides
which engine's pool a prompt lands in; it cannot make the fleet hold more than its pools do.
This script replays the committed Mooncake trace, in arrival order, through a single LRU radix
cache sized to the fleet's total KV (engines x the per-engine pool at each fraction of the
preset's default), with no routing, no engine and no queue: every prompt sees every token any
earlier prompt left, as if the eight pools were one. It is sim_pooled_lru.py's pooled baseline
(which compares it with cache_aware at the default pool for 4, 8 and 16 engines), at the
sweep's pool sizes.

    python benchmarks/kv_pooled_reference.py [--fractions 1 0.5 ...] [--subsample 0 1 2 3]

`--subsample` drops the same seeded 10% of the requests as the sweep's, so each row lines up
with a row of the sweep's table. Deterministic; about two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_line  # noqa: E402
from kv_aware_sweep import FRACTIONS, PRESET, TRACE, requests  # noqa: E402
from radixserve.sim.costmodel import get_cost_model  # noqa: E402
from sim_pooled_lru import lru_hit_rate  # noqa: E402


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
    workloads = {seed: requests("mooncake", None, seed) for seed in args.subsample}
    for fraction in args.fractions:
        per_engine = int(pool * fraction)
        for seed, reqs in workloads.items():
            rate = lru_hit_rate(reqs, 1, per_engine * args.engines, lambda r: 0)
            drop = f"s{seed}" if seed else "-"
            print(f"{per_engine:>10,} {per_engine * args.engines:>11,} {drop:>4}  {rate:14.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
