"""The seeds' claims about cache-aware scheduling and routing, reproduced in the simulator.

(i) engine level: FCFS against LPM on 32 requests sent at once, 24 of which share a 2,000-token
    system prompt and 8 unrelated (one llama3-8b-h100 engine, its whole KV pool).
(ii) cluster level: round robin against cache-aware routing on long prefix groups, perfectly
    balanced: 32 groups x 16 prompts (4,096-token system prompt, 128-token question, 128 output
    tokens) on 8 engines, all sent at once, LPM on every engine. Targets: throughput ratio
    >= 1.9x (SGLang reported 82,665 -> 158,596 tokens/s), hit rate >= 95% of the best any
    placement reaches (one unbounded cache; computed and printed), busiest engine <= 1.10x the
    mean (by requests and by busy time).
The hit-rate versus wait curve as --max-wait-ms varies is benchmarks/max_wait_tradeoff.py.

    python benchmarks/sim_claims.py [--seeds 3]

Exits 1 if a target is missed. Results are simulated, not timed: they repeat exactly.
"""

from __future__ import annotations

import argparse
import random
import sys

from _machine import machine_line
from radixserve.config import SchedulerConfig
from radixserve.sim.cluster import ClusterConfig, simulate
from radixserve.sim.report import SimResult, format_table
from radixserve.sim.workloads import (
    SharedPrefixConfig,
    WorkloadRequest,
    generated_shared_prefix,
    ideal_prefix_hit_rate,
)

PRESET = "llama3-8b-h100"


def burst(seed: int) -> list[WorkloadRequest]:
    """32 requests at time 0: 24 share a 2,000-token system prompt, 8 are unrelated."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(2000)]
    prompts = [system + [rng.randrange(32000) for _ in range(32)] for _ in range(24)]
    prompts += [[rng.randrange(32000) for _ in range(2032)] for _ in range(8)]
    rng.shuffle(prompts)
    return [WorkloadRequest(f"r{i}", 0.0, p, 8) for i, p in enumerate(prompts)]


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")
    return ok


def engine_level(seed: int) -> bool:
    reqs = burst(seed)
    best = ideal_prefix_hit_rate(reqs)
    print(f"\n(i) engine level, seed {seed}: 1 x {PRESET}, 32 requests (24 share 2,000 tokens)")
    runs = [
        simulate(
            reqs,
            ClusterConfig(engines=1, preset=PRESET),
            SchedulerConfig(schedule_policy=p),
            label=p,
            best_hit_rate=best,
        )
        for p in ("fcfs", "lpm")
    ]
    print(format_table(runs))
    fcfs, lpm = runs
    return check(
        "LPM reaches the best hit rate",
        lpm.hit_rate >= 0.95 * best,
        f"{lpm.hit_rate:.1%} of best {best:.1%} (FCFS {fcfs.hit_rate:.1%})",
    )


def cluster_level(seed: int) -> bool:
    cfg = SharedPrefixConfig(
        num_groups=32,
        prompts_per_group=16,
        system_prompt_len=4096,
        question_len=128,
        output_len=128,
        seed=seed,
    )
    reqs = generated_shared_prefix(cfg)
    best = ideal_prefix_hit_rate(reqs)
    print(
        f"\n(ii) cluster level, seed {seed}: 8 x {PRESET}, {cfg.num_groups} groups x "
        f"{cfg.prompts_per_group} prompts, {cfg.system_prompt_len}-token system prompts"
    )
    runs: list[SimResult] = [
        simulate(
            reqs, ClusterConfig(engines=8, router=r, preset=PRESET), label=r, best_hit_rate=best
        )
        for r in ("round_robin", "cache_aware")
    ]
    print(format_table(runs))
    rr, ca = runs
    ratio = ca.output_throughput / rr.output_throughput
    imb = ca.imbalance()
    return all(
        [
            check("throughput ratio >= 1.9x", ratio >= 1.9, f"x{ratio:.2f}"),
            check(
                "hit rate >= 95% of the best placement",
                ca.hit_rate >= 0.95 * best,
                f"{ca.hit_rate:.1%} / {best:.1%} = {ca.hit_rate / best:.1%} "
                f"(round robin {rr.hit_rate:.1%})",
            ),
            check(
                "busiest engine <= 1.10x the mean",
                max(imb["requests"], imb["busy_s"]) <= 1.10,
                f"requests x{imb['requests']:.2f}, busy time x{imb['busy_s']:.2f}",
            ),
        ]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=1, help="workload seeds to run (0, 1, ...)")
    args = ap.parse_args()
    print(machine_line())
    ok = True
    for seed in range(args.seeds):
        ok &= engine_level(seed)
        ok &= cluster_level(seed)
    print("\nall targets met" if ok else "\nsome targets missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
