"""Prefill and decode apart, simulated: N aggregated engines against every xPyD split of the
same N on Mooncake's trace, with TTFT, time between tokens and goodput at two TBT SLOs.

Simulated fleet (the real schedulers and radix caches, the router's policies: cache_aware picks
the engine that prefills, least_load the one that decodes; sim/pd.py) of `llama3-8b-h100`
engines, the KV sent at the preset's 40 GB/s per GPU. Goodput as Mooncake and DistServe count
it: the requests whose TTFT and every gap between two of their tokens are within the bounds.
Each run gives goodput at every SLO; the table marks the best split per TBT bound and its
goodput against the aggregated fleet's.

    python benchmarks/sim_pd_sweep.py [--engines 8] [--limit 0] [--jobs 2]
        [--slo-ttft-ms 5000] [--slo-tbt-ms 50 300] [--json PATH]

Results are simulated on a virtual clock: they repeat exactly, whatever the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import machine_line  # noqa: E402
from radixserve.sim.cluster import ClusterConfig, simulate  # noqa: E402
from radixserve.sim.pd import simulate_pd  # noqa: E402
from radixserve.sim.report import SimResult, summarize  # noqa: E402
from radixserve.sim.slo import SloConfig  # noqa: E402
from radixserve.sim.workloads import TraceConfig, trace_replay  # noqa: E402

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"
PRESET = "llama3-8b-h100"


def one(args: tuple[int, tuple[int, int] | None, int]) -> tuple[str, dict, list, list, float]:
    """One fleet over the trace: its report, each request's TTFT and longest gap, wall time."""
    engines, split, limit = args
    reqs = trace_replay(TraceConfig(path=str(TRACE), limit=limit or None))
    config = ClusterConfig(engines=engines, preset=PRESET, router="cache_aware")
    wall = time.perf_counter()
    if split is None:
        res = simulate(reqs, config, label="aggregated")
    else:
        res = simulate_pd(reqs, split, config)
    return res.label, res.to_dict(), res.ttft, res.tbt_worst, time.perf_counter() - wall


def goodput(doc: dict, ttft: list, worst: list, slo: SloConfig) -> float:
    res = SimResult(doc["label"], doc["num_requests"], [], slo=slo)
    res.ttft, res.tbt_worst = ttft, worst
    res.num_finished, res.first_arrival, res.last_finish = len(ttft), 0.0, doc["duration_s"]
    return res.goodput()[0]  # type: ignore[index]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--limit", type=int, default=0, help="first N requests (0: the whole trace)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--prefill", type=int, nargs="+", help="prefill engines of each split (all)")
    ap.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    ap.add_argument("--slo-tbt-ms", type=float, nargs="+", default=[50.0, 300.0])
    ap.add_argument("--json", type=Path, help="write the runs (each request's TTFT and gap too)")
    ap.add_argument("--from-json", type=Path, help="print the table of runs written by --json")
    a = ap.parse_args()
    n = a.engines
    splits = [None, *((x, n - x) for x in (a.prefill or range(1, n)))]
    print(f"workload: {TRACE.name}" + (f", first {a.limit} requests" if a.limit else ", whole"))
    print(f"fleet: {n} x {PRESET}, router cache_aware (prefill) + least_load (decode)")
    print(machine_line())
    if a.from_json:
        runs = json.loads(a.from_json.read_text())
    else:
        with ProcessPoolExecutor(a.jobs) as pool:
            runs = list(pool.map(one, [(n, s, a.limit) for s in splits]))
    if a.json:
        a.json.write_text(json.dumps(runs, default=str))
    print_table(runs, [SloConfig(a.slo_ttft_ms, tbt) for tbt in a.slo_tbt_ms])
    return 0


def print_table(runs: list, slos: list[SloConfig]) -> None:
    heads = [f"goodput TBT<={s.slo_tbt_ms:g}ms" for s in slos]
    cols = ["fleet", "done", "out tok/s", "hit", "TTFT p50/p99 s", "TBT p50/p99 ms", *heads]
    print(
        f"goodput: TTFT <= {slos[0].slo_ttft_ms:g} ms and every gap between tokens <= the TBT bound"
    )
    print(" | ".join(cols))
    good = {}
    for label, doc, ttft, worst, _wall in runs:
        t, tbt = summarize(ttft), doc["tbt_s"]
        g = [goodput(doc, ttft, worst, s) for s in slos]
        good[label] = g
        print(" | ".join([
            label, f"{doc['num_finished']}/{doc['num_requests']}", f"{doc['output_throughput']:,.0f}",
            f"{doc['hit_rate']:.1%}", f"{t['p50']:.2f}/{t['p99']:.2f}",
            f"{1e3 * tbt['p50']:.1f}/{1e3 * tbt['p99']:.1f}", *(f"{x:.1%}" for x in g),
        ]))  # fmt: skip
    agg = good["aggregated"]
    for i, s in enumerate(slos):
        best = max((lb for lb in good if lb != "aggregated"), key=lambda lb: good[lb][i])
        ratio = good[best][i] / agg[i] if agg[i] else float("inf")
        print(f"TBT <= {s.slo_tbt_ms:g} ms: best split {best} {good[best][i]:.1%} against "
              f"aggregated {agg[i]:.1%}: x{ratio:.2f}")  # fmt: skip
    print(f"wall: {sum(r[4] for r in runs):.0f} s of simulation")


if __name__ == "__main__":
    sys.exit(main())
