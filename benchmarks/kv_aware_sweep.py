"""kv_aware against cache_aware as the engines' KV pools shrink (issue 12, acceptance 4).

Simulated fleet (the real schedulers, radix caches, router policies; engines' KV events fed in
process to kv_aware's index), swept over the per-engine KV size from the preset's default down
to a twentieth, on two workloads: Mooncake's synthetic trace (traces/, 3,993 requests at their
trace times) and multi-turn chat (sessions whose histories grow turn by turn). Prints, per
workload and size: each policy's prefix hit rate, TTFT p99 and busiest engine's busy time over
the mean, and kv_aware against cache_aware (the strongest baseline) in the same run.

    python benchmarks/kv_aware_sweep.py [--jobs 4] [--plot sweep.png] [--limit N]
                                        [--subsample SEED ...]

Results are simulated on a virtual clock: they repeat exactly, whatever the machine. They are
not smooth in the policy, though: a hit rate is decided by a few long prompts (on Mooncake one
request of 374 blocks moves it by 0.2 points), so a handful of different decisions moves it by
a point either way. `--subsample SEED` reruns each point on the workload with a seeded 10% of
its requests dropped (the same subset for both policies), to show how much of a difference
between the policies outlasts such a perturbation (0 is the whole workload). With more than one
seed, a summary follows: mean hit rates over the runs, in how many runs kv_aware's was at
least cache_aware's, and kv_aware's worst TTFT p99 ratio and busiest engine.
"""

from __future__ import annotations

import argparse
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import machine_line  # noqa: E402
from radixserve.config import CacheConfig  # noqa: E402
from radixserve.sim.cluster import ClusterConfig, simulate  # noqa: E402
from radixserve.sim.costmodel import get_cost_model  # noqa: E402
from radixserve.sim.report import max_over_mean, percentile  # noqa: E402
from radixserve.sim.runner import SimRunner  # noqa: E402
from radixserve.sim.workloads import (  # noqa: E402
    MultiTurnConfig,
    TraceConfig,
    multi_turn_chat,
    trace_replay,
)

PRESET = "llama3-8b-h100"
TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"
CHAT = MultiTurnConfig(
    num_sessions=512,
    turns=6,
    system_prompt_len=1024,
    user_len=256,
    output_len=128,
    think_time_s=3.0,
    request_rate=16.0,
)
FRACTIONS = (1.0, 0.5, 0.25, 0.1, 0.05)
ROUTERS = ("cache_aware", "kv_aware")


def requests(workload: str, limit: int | None, subsample: int = 0) -> list:
    """The workload; with a nonzero `subsample` seed, about 10% of it dropped: trace requests
    one by one, chat sessions whole (a later turn waits on the turn before it)."""
    if workload == "mooncake":
        reqs = trace_replay(TraceConfig(path=str(TRACE), limit=limit))
    else:
        reqs = multi_turn_chat(CHAT, SimRunner(PRESET).generate)
        reqs = reqs[:limit] if limit else reqs
    if not subsample:
        return reqs
    rng, drop = random.Random(subsample), {}
    for r in reqs:
        key = r.session or r.rid
        if key not in drop:
            drop[key] = rng.random() < 0.1
    return [r for r in reqs if not drop[r.session or r.rid]]


def one(job: tuple[str, float, str, int | None, int, int]) -> dict:
    workload, fraction, router, limit, engines, subsample = job
    kv = int(get_cost_model(PRESET).kv_capacity_tokens * fraction)
    res = simulate(
        requests(workload, limit, subsample),
        ClusterConfig(engines=engines, router=router, preset=PRESET),
        cache_config=CacheConfig(max_total_tokens=kv),
        label=router,
        block_tokens=512 if workload == "mooncake" else None,
    )
    assert res.num_unfinished == 0, "a request was lost"
    return {
        "workload": workload, "fraction": fraction, "kv": kv, "router": router, "seed": subsample,
        "hit": res.hit_rate, "ttft_p99": percentile(sorted(res.ttft), 99),
        "busy": max_over_mean([e.busy_s for e in res.engines]),
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    by = {(r["workload"], r["fraction"], r["seed"], r["router"]): r for r in rows}
    out = [
        f"{'workload':9} {'KV/engine':>10} {'drop':>4}  {'hit cache/kv':>14}  "
        f"{'TTFT p99 s cache/kv':>20}  {'busy max/mean cache/kv':>23}  {'kv hit - cache hit':>18}"
    ]
    for wl, frac, seed in dict.fromkeys((r["workload"], r["fraction"], r["seed"]) for r in rows):
        c, k = by[wl, frac, seed, "cache_aware"], by[wl, frac, seed, "kv_aware"]
        drop = f"s{seed}" if seed else "-"
        out.append(
            f"{wl:9} {c['kv']:>10,} {drop:>4}  {c['hit']:6.1%}/{k['hit']:6.1%}  "
            f"{c['ttft_p99']:9.2f}/{k['ttft_p99']:<9.2f}  {c['busy']:11.2f}/{k['busy']:<11.2f}  "
            f"{(k['hit'] - c['hit']) * 100:+17.1f}pt"
        )
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    """Per workload and size, over the whole workload and its subsamples: the mean hit rates,
    in how many runs kv_aware's hit rate was at least cache_aware's, kv_aware's worst TTFT p99
    against cache_aware's in the same run, and kv_aware's busiest engine over the mean."""
    by = {(r["workload"], r["fraction"], r["seed"], r["router"]): r for r in rows}
    out = [
        f"{'workload':9} {'KV/engine':>10} {'runs':>4}  {'mean hit cache/kv':>17}  "
        f"{'mean kv - cache':>15}  {'kv >= cache':>11}  {'worst TTFT p99 kv/cache':>23}  "
        f"{'worst kv busy':>13}"
    ]
    for wl, frac in dict.fromkeys((r["workload"], r["fraction"]) for r in rows):
        seeds = [s for (w, f, s, r) in by if (w, f, r) == (wl, frac, "kv_aware")]
        pairs = [(by[wl, frac, s, "cache_aware"], by[wl, frac, s, "kv_aware"]) for s in seeds]
        cache = sum(c["hit"] for c, _ in pairs) / len(pairs)
        kv = sum(k["hit"] for _, k in pairs) / len(pairs)
        wins = sum(k["hit"] >= c["hit"] for c, k in pairs)
        ttft = max(k["ttft_p99"] / c["ttft_p99"] for c, k in pairs)
        busy = max(k["busy"] for _, k in pairs)
        out.append(
            f"{wl:9} {pairs[0][0]['kv']:>10,} {len(pairs):>4}  {cache:7.2%}/{kv:<7.2%}  "
            f"{(kv - cache) * 100:+13.2f}pt  {wins:>7}/{len(pairs):<3}  {ttft:22.2f}x  {busy:13.3f}"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    for col, wl in enumerate(workloads):
        for router in ROUTERS:
            mine = sorted(
                (r for r in rows if r["workload"] == wl and r["router"] == router),
                key=lambda r: r["kv"],
            )
            kv = [r["kv"] for r in mine]
            axes[0][col].plot(kv, [100 * r["hit"] for r in mine], "o-", label=router)
            axes[1][col].plot(kv, [r["ttft_p99"] for r in mine], "o-", label=router)
        axes[0][col].set_title(f"{wl}: prefix hit rate (%)")
        axes[1][col].set_title(f"{wl}: TTFT p99 (s)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log")
            ax.set_xlabel("KV tokens per engine")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["mooncake", "chat"])
    parser.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument(
        "--subsample",
        nargs="+",
        type=int,
        default=[0],
        metavar="SEED",
        help="also run each point with a seeded 10%% of the requests dropped (0: all of them)",
    )
    args = parser.parse_args()
    print(machine_line())
    print(f"fleet: {args.engines} x {PRESET}; KV per engine: default x {args.fractions}")
    print(f"workloads: mooncake = {TRACE.name} (limit {args.limit}); chat = {CHAT}")
    jobs = [
        (wl, f, r, args.limit, args.engines, seed)
        for wl in args.workloads
        for f in args.fractions
        for seed in args.subsample
        for r in ROUTERS
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, jobs))
    print(table(rows))
    if len(args.subsample) > 1:
        print("\nover the whole workload and its subsamples:")
        print(summary(rows))
    if args.plot:
        plot([r for r in rows if r["seed"] == args.subsample[0]], args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
