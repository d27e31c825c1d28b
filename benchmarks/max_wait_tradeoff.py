"""What --max-wait-ms trades: cache hit rate against the wait tail, T from 0 to infinite.

One simulated engine (cost-model preset llama3-8b-h100 by default, SimRunner, virtual clock),
two workloads with Poisson arrivals near what the engine serves:
  hot-cold   95% extend one hot 2,000-token system prompt, 5% are cold; 8 running slots. Pure
             LPM (T = inf) admits a cold request only when no hot one waits: its tail grows.
  zipf-tight 90% extend one of 8 system prompts (Zipf popularity), 10% cold, in a KV pool that
             holds 6 of the 8 prompts; 16 running slots. LPM runs a cached group's requests
             together before its prompt is evicted: a higher hit rate and more throughput.
T = 0 admits in arrival order (FCFS, plus in-batch prefix dedupe); the FCFS baseline runs the
same requests in the same process. Wait = first scheduled - arrival, in simulated seconds.

    python benchmarks/max_wait_tradeoff.py [--scenarios hot-cold zipf-tight] [--preset NAME]

Results are simulated, not timed, so they repeat exactly; only the run time is measured.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import deque
from dataclasses import dataclass

from _machine import machine_line
from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.request import Req, SamplingParams
from radixserve.sched.scheduler import Scheduler
from radixserve.sim.runner import SimRunner

VOCAB = 32000


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int
    rate: float  # Poisson arrivals per second
    groups: int  # hot system prompts, Zipf(1) popularity
    system_len: int
    question_len: int
    cold_share: float  # requests with a prompt of their own
    output_len: int
    seed: int

    def describe(self) -> str:
        hot = "one" if self.groups == 1 else f"one of {self.groups} (Zipf popularity)"
        return (
            f"{self.requests} requests, Poisson {self.rate:g} req/s, {self.output_len} output "
            f"tokens each; {1 - self.cold_share:.0%} = {hot} {self.system_len}-token system "
            f"prompt + {self.question_len}-token question, {self.cold_share:.0%} cold "
            f"{self.system_len + self.question_len}-token prompts (seed {self.seed})"
        )

    def make(self) -> list[tuple[float, str, list[int], bool]]:
        """(arrival s, id, prompt, is cold), in arrival order."""
        rng = random.Random(self.seed)
        systems = [
            [rng.randrange(VOCAB) for _ in range(self.system_len)] for _ in range(self.groups)
        ]
        weights = [1 / (g + 1) for g in range(self.groups)]
        out, t = [], 0.0
        for i in range(self.requests):
            t += rng.expovariate(self.rate)
            cold = rng.random() < self.cold_share
            prefix = [] if cold else rng.choices(systems, weights)[0]
            n = self.system_len + self.question_len - len(prefix)
            out.append((t, f"r{i}", prefix + [rng.randrange(VOCAB) for _ in range(n)], cold))
        return out


@dataclass(slots=True)
class Result:
    hit_rate: float
    waits: list[float]  # sorted
    cold_waits: list[float]  # sorted
    throughput: float  # output tokens per simulated second
    steps: int


def percentile(xs: list[float], p: float) -> float:
    """Nearest-rank percentile of sorted ``xs``."""
    return xs[max(0, math.ceil(p / 100 * len(xs)) - 1)]


def simulate(
    work: list[tuple[float, str, list[int], bool]],
    cfg: SchedulerConfig,
    pool: int,
    preset: str,
    output_len: int,
) -> Result:
    now = [0.0]
    sched = Scheduler(cfg, CacheConfig(max_total_tokens=pool), clock=lambda: now[0])
    runner = SimRunner(preset)
    pending, reqs, steps = deque(work), [], 0
    while True:
        while pending and pending[0][0] <= now[0]:
            t, rid, ids, cold = pending.popleft()
            sp = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
            reqs.append((Req(rid, ids, sp, arrival_time=t), cold))
            sched.add_request(reqs[-1][0])
        batch = sched.step()
        if batch is None:
            if not pending:
                break
            now[0] = pending[0][0]
            continue
        result = runner.run(batch)
        now[0] += result.duration or 0.0
        sched.on_output(batch, result)
        steps += 1
    sched.check_integrity()
    waits = {r.rid: r.first_scheduled_time - r.arrival_time for r, _ in reqs}  # type: ignore[operator]
    return Result(
        hit_rate=sched.cache_hit_rate,
        waits=sorted(waits.values()),
        cold_waits=sorted(waits[r.rid] for r, cold in reqs if cold),
        throughput=len(reqs) * output_len / now[0],
        steps=steps,
    )


@dataclass(frozen=True, slots=True)
class Scenario:
    work: Workload
    kv_tokens: int
    max_running: int


SCENARIOS = {
    "hot-cold": Scenario(Workload(600, 13.0, 1, 2000, 50, 0.05, 64, 0), 30000, 8),
    "zipf-tight": Scenario(Workload(800, 11.0, 8, 2000, 100, 0.1, 64, 0), 12000, 16),
}


def show(name: str, sc: Scenario, preset: str, policy: str, waits: list[float]) -> None:
    reqs = sc.work.make()
    print(f"\n{name} workload: {sc.work.describe()}")
    print(
        f"engine: 1 x {preset} (simulated), KV pool {sc.kv_tokens:,} tokens, "
        f"{sc.max_running} running slots, policy {policy}, other SchedulerConfig defaults"
    )

    def run(policy: str, wait_ms: float | None) -> Result:
        cfg = SchedulerConfig(
            schedule_policy=policy, max_wait_ms=wait_ms, max_running_requests=sc.max_running
        )
        return simulate(reqs, cfg, sc.kv_tokens, preset, sc.work.output_len)

    base = run("fcfs", None)
    rows = [("fcfs", base)]
    rows += [(f"{w:g}", run(policy, None if math.isinf(w) else w)) for w in waits]
    head = f"{'max-wait-ms':>12}{'hit rate':>9}{'wait p50':>9}{'p99':>7}{'max':>7}{'cold p99':>9}"
    print(head + f"{'out tok/s':>10}{'hit/fcfs':>9}{'p99/fcfs':>9}")
    for label, r in rows:
        p99 = percentile(r.waits, 99)
        print(
            f"{label:>12}{r.hit_rate:9.1%}{percentile(r.waits, 50):9.2f}{p99:7.2f}"
            f"{r.waits[-1]:7.2f}{percentile(r.cold_waits, 99):9.2f}{r.throughput:10,.0f}"
            f"{r.hit_rate / base.hit_rate:8.2f}x{p99 / percentile(base.waits, 99):8.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--preset", default="llama3-8b-h100", help="cost-model preset")
    ap.add_argument("--policy", default="lpm", choices=["lpm", "dfs-weight"])
    ap.add_argument(
        "--waits", type=float, nargs="+", default=[0, 10, 50, 200, 1000, math.inf], help="T, ms"
    )
    args = ap.parse_args()
    print(machine_line())
    t0 = time.perf_counter()
    for name in args.scenarios:
        show(name, SCENARIOS[name], args.preset, args.policy, args.waits)
    print(f"\nwaits in simulated seconds; {time.perf_counter() - t0:.1f} s to run")


if __name__ == "__main__":
    main()
