"""The fleet with lower KV tiers (issue 27 item 6, issue 28 item 4): device-only kv_aware
against kv_aware over each engine's host tier and a fleet-wide KV store, as the engines' KV
pools shrink; then the store's size swept.

Simulated fleet (the real schedulers, radix caches with their host tiers, router policies; the
store and the copy times from the preset's tiers, sim/tiers.py) of 8 engines, on Mooncake's
trace (traces/) and multi-turn chat, per-engine KV from the preset's default down to a
twentieth. With tiers: a host tier of twice the device pool per engine (SGLang's default
--hicache-ratio) and a store sized to the workload's working set (every distinct block it
ever computes), kv_aware scoring store hits at their load time (issue 28's tier-aware score).
Prints per workload and size: hit rate counting every tier against the best one unbounded
cache reaches (goal: >= 95% of it), hits by tier, TTFT mean and p99 and throughput against
device-only kv_aware in the same run; then, at one pool size, hit rate and TTFT as the store
shrinks from the working set to a tenth of it.

    python benchmarks/sim_tiers_sweep.py [--jobs 2] [--plot docs/sim_tiers_sweep.png]
        [--limit N] [--sessions N] [--fractions F ...] [--store-fractions F ...]

Defaults replay the trace's first 1,000 requests and 192 chat sessions, so that the whole run
stays under 15 minutes on two busy cores; `--limit 0 --sessions 512` runs both whole. Results
are simulated on a virtual clock: they repeat exactly, whatever the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import machine_line  # noqa: E402
from kv_aware_sweep import CHAT, FRACTIONS, PRESET, TRACE  # noqa: E402
from radixserve.config import CacheConfig  # noqa: E402
from radixserve.sim.cluster import ClusterConfig, simulate  # noqa: E402
from radixserve.sim.costmodel import get_cost_model  # noqa: E402
from radixserve.sim.runner import SimRunner  # noqa: E402
from radixserve.sim.tiers import SimStore, SimTierConfig, gb_for_tokens  # noqa: E402
from radixserve.sim.workloads import (  # noqa: E402
    TraceConfig,
    ideal_prefix_hit_rate,
    multi_turn_chat,
    trace_replay,
)

# the workloads, the preset and the pool fractions of the kv_aware sweep, so the two compare
STORE_FRACTIONS = (1.0, 0.5, 0.2, 0.1)
BLOCK = 16  # store block tokens (the sim's default)


def requests(workload: str, limit: int, sessions: int) -> list:
    if workload == "mooncake":
        return trace_replay(TraceConfig(path=str(TRACE), limit=limit or None))
    cfg = dataclasses.replace(CHAT, num_sessions=sessions)
    return multi_turn_chat(cfg, SimRunner(PRESET).generate)


def outputs(workload: str):  # noqa: ANN201  (a callable or None)
    """What each request's reply is, for chat (its history is cached and reused)."""
    if workload != "chat":
        return None
    runner = SimRunner(PRESET)
    return lambda r: runner.generate(r.input_ids, r.output_len)


def working_set(reqs: list, workload: str) -> int:
    """Tokens of every distinct store block the workload writes (prompts and replies)."""
    store, seen, runner = SimStore(0, BLOCK), set(), SimRunner(PRESET)
    for r in reqs:
        seq = list(r.input_ids)
        seq += runner.generate(r.input_ids, r.output_len)[:-1]  # written once it finishes
        seen.update(store.keys(seq))
    return len(seen) * BLOCK


def one(job: tuple) -> dict:
    workload, fraction, variant, store_frac, limit, sessions, engines, ws = job
    cost = get_cost_model(PRESET)
    kv = int(cost.kv_capacity_tokens * fraction)
    reqs = requests(workload, limit, sessions)
    if variant == "device":
        cache, tiers = CacheConfig(max_total_tokens=kv), SimTierConfig()
    else:
        cache = CacheConfig(max_total_tokens=kv, enable_hierarchical_cache=True, hicache_ratio=2.0)
        tiers = SimTierConfig(kv_store_gb=gb_for_tokens(int(ws * store_frac), cost))
    res = simulate(
        reqs,
        ClusterConfig(engines=engines, router="kv_aware", preset=PRESET, tiers=tiers),
        cache_config=cache,
        label=variant,
    )
    assert res.num_unfinished == 0, "a request was lost"
    best = None
    if res.num_rejected:  # prompts longer than the pool: the best counts the served ones only
        served = [r for r in reqs if r.rid not in res.rejected_rids]
        best = ideal_prefix_hit_rate(served, 1, outputs(workload))
    d = res.to_dict()
    return {
        "workload": workload, "fraction": fraction, "kv": kv, "variant": variant,
        "store_frac": store_frac, "hit": res.hit_rate, "tiers": res.tier_hit_rates(),
        "ttft_mean": d["ttft_s"]["mean"], "ttft_p99": d["ttft_s"]["p99"],
        "tput": res.total_throughput, "out_tput": res.output_throughput,
        "rejected": res.num_rejected, "best": best,
    }  # fmt: skip


def share(hit: float, best: float) -> float:
    return hit / best if best else float("nan")


def table(rows: list[dict], best: dict[str, float]) -> str:
    by = {(r["workload"], r["fraction"], r["variant"], r["store_frac"]): r for r in rows}
    out = [
        f"{'workload':9} {'KV/engine':>10}  {'hit dev-only':>12}  {'hit tiers':>9}  "
        f"{'best':>5}  {'of best':>7}  {'device/host/store %':>19}  {'TTFT mean s dev/tiers':>21}  "
        f"{'TTFT p99 s dev/tiers':>20}  {'tok/s tiers/dev':>15}"
    ]
    order = list(dict.fromkeys(r["workload"] for r in rows))
    points = sorted({(r["workload"], r["fraction"]) for r in rows},
                    key=lambda p: (order.index(p[0]), -p[1]))  # fmt: skip
    for wl, frac in points:
        d, t = by.get((wl, frac, "device", 0.0)), by.get((wl, frac, "tiers", 1.0))
        if d is None or t is None:
            continue
        split = "/".join(f"{100 * t['tiers'][k]:.1f}" for k in ("device", "host", "store"))
        top = t["best"] or best[wl]
        out.append(
            f"{wl:9} {d['kv']:>10,}  {d['hit']:12.1%}  {t['hit']:9.1%}  "
            f"{top:5.1%}  {share(t['hit'], top):7.1%}  {split:>19}  "
            f"{d['ttft_mean']:10.2f}/{t['ttft_mean']:<10.2f}  "
            f"{d['ttft_p99']:9.2f}/{t['ttft_p99']:<10.2f}  {t['tput'] / d['tput']:14.2f}x"
            + (f"  ({t['rejected']} prompts longer than the pool refused)" if t["rejected"] else "")
        )
    return "\n".join(out)


def store_table(rows: list[dict], best: dict[str, float], ws: dict[str, int]) -> str:
    out = [
        f"{'workload':9} {'KV/engine':>10}  {'store tokens':>12}  {'of WS':>6}  {'hit':>6}  "
        f"{'of best':>7}  {'store hits':>10}  {'TTFT mean/p99 s':>16}"
    ]
    mine = [r for r in rows if r["variant"] == "tiers"]
    for wl, frac in dict.fromkeys((r["workload"], r["fraction"]) for r in mine):
        points = sorted(
            (r for r in mine if (r["workload"], r["fraction"]) == (wl, frac)),
            key=lambda r: -r["store_frac"],
        )
        if len(points) < 2:
            continue
        for r in points:
            out.append(
                f"{wl:9} {r['kv']:>10,}  {int(ws[wl] * r['store_frac']):>12,}  "
                f"{r['store_frac']:6.0%}  {r['hit']:6.1%}  {share(r['hit'], r['best'] or best[wl]):7.1%}  "
                f"{r['tiers']['store']:10.1%}  {r['ttft_mean']:7.2f}/{r['ttft_p99']:<8.2f}"
            )
    return "\n".join(out)


def plot(rows: list[dict], best: dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(3, len(workloads), figsize=(5.5 * len(workloads), 10), squeeze=False)
    for col, wl in enumerate(workloads):
        for variant, name in (("device", "kv_aware, device only"), ("tiers", "kv_aware + tiers")):
            mine = sorted(
                (
                    r
                    for r in rows
                    if r["workload"] == wl
                    and r["variant"] == variant
                    and r["store_frac"] in (0.0, 1.0)
                ),
                key=lambda r: r["kv"],
            )
            kv = [r["kv"] for r in mine]
            axes[0][col].plot(kv, [100 * r["hit"] for r in mine], "o-", label=name)
            axes[1][col].plot(kv, [r["ttft_mean"] for r in mine], "o-", label=f"{name}, mean")
            axes[1][col].plot(kv, [r["ttft_p99"] for r in mine], "s--", label=f"{name}, p99")
        tops = sorted(
            (r["kv"], r["best"] or best[wl])
            for r in rows
            if r["workload"] == wl and r["variant"] == "device"
        )
        kvs, top = [k for k, _ in tops], [100 * b for _, b in tops]
        axes[0][col].plot(kvs, top, color="grey", ls=":", label="one unbounded cache")
        axes[0][col].plot(kvs, [0.95 * b for b in top], color="grey", ls="-.", lw=0.8,
                          label="95% of it")  # fmt: skip
        axes[0][col].set_title(f"{wl}: prefix hit rate, every tier (%)")
        axes[1][col].set_title(f"{wl}: TTFT (s)")
        axes[1][col].set_yscale("log")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log")
            ax.set_xlabel("device KV tokens per engine")
            ax.legend(fontsize=7)
        sweep = sorted(
            (r for r in rows if r["workload"] == wl and r["variant"] == "tiers"),
            key=lambda r: r["store_frac"],
        )
        frac = min(r["fraction"] for r in sweep)
        sweep = [r for r in sweep if r["fraction"] == frac]
        ax = axes[2][col]
        ax.plot([100 * r["store_frac"] for r in sweep], [100 * r["hit"] for r in sweep], "o-")
        ax.axhline(100 * (sweep[0]["best"] or best[wl]), color="grey", ls=":")
        ax.set_xscale("log")
        ax.set_title(f"{wl}: hit rate (%) vs store size, KV/engine x{frac:g}")
        ax.set_xlabel("store size (% of the working set)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def key(row: dict) -> tuple:
    return (row["workload"], row["fraction"], row["variant"], row["store_frac"])


def load_rows(logs: list[str]) -> list[dict]:
    """The rows earlier runs printed (``row: {...}`` lines), the last of each point kept."""
    rows: dict[tuple, dict] = {}
    for log in logs:
        for line in Path(log).read_text(encoding="utf-8").splitlines():
            if line.startswith("row: "):
                row = json.loads(line[5:])
                rows[key(row)] = row
    return list(rows.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["mooncake", "chat"])
    parser.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    parser.add_argument(
        "--store-fractions",
        nargs="+",
        type=float,
        default=list(STORE_FRACTIONS),
        help="store sizes (share of the working set) swept at the smallest KV fraction",
    )
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--limit", type=int, default=1000, help="trace: first N requests (0: all)")
    parser.add_argument("--sessions", type=int, default=192, help="chat sessions (512: whole)")
    parser.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument(
        "--resume",
        nargs="+",
        default=[],
        metavar="LOG",
        help="rows printed by earlier runs (their output): those points are not run again",
    )
    args = parser.parse_args()
    print(machine_line())
    cost = get_cost_model(PRESET)
    print(
        f"fleet: {args.engines} x {PRESET}, kv_aware; KV per engine: default "
        f"{cost.kv_capacity_tokens:,} x {args.fractions}; tiers: host 2x the pool, "
        f"{cost.tier_spec()}, load/prefill ratio {cost.load_to_prefill_ratio():.2f}"
    )
    print(f"workloads: mooncake = {TRACE.name} (limit {args.limit or 'none'}); chat = "
          f"{dataclasses.replace(CHAT, num_sessions=args.sessions)}")  # fmt: skip
    best, ws = {}, {}
    for wl in args.workloads:
        reqs = requests(wl, args.limit, args.sessions)
        best[wl] = ideal_prefix_hit_rate(reqs, 1, outputs(wl))
        ws[wl] = working_set(reqs, wl)
        print(
            f"{wl}: {len(reqs)} requests, best hit rate {best[wl]:.1%}, working set "
            f"{ws[wl]:,} tokens ({gb_for_tokens(ws[wl], cost):.0f} GB of KV)"
        )
    smallest = min(args.fractions)
    jobs = []
    for wl in args.workloads:
        common = (args.limit, args.sessions, args.engines, ws[wl])
        for f in args.fractions:
            jobs.append((wl, f, "device", 0.0, *common))
            jobs.append((wl, f, "tiers", 1.0, *common))
        for s in args.store_fractions:
            if s != 1.0:
                jobs.append((wl, smallest, "tiers", s, *common))
    rows = [r for r in load_rows(args.resume) if r["workload"] in args.workloads]
    have = {key(r) for r in rows}
    jobs = [j for j in jobs if (j[0], j[1], j[2], j[3]) not in have]
    with ProcessPoolExecutor(args.jobs) as pool:  # each row printed as it comes (JSON)
        for done in as_completed([pool.submit(one, job) for job in jobs]):
            rows.append(done.result())
            print("row:", json.dumps(rows[-1]), flush=True)
    print(table(rows, best))
    print(f"\nstore size swept at KV/engine x{smallest:g} (WS: the working set):")
    print(store_table(rows, best, ws))
    if args.plot:
        plot(rows, best, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
