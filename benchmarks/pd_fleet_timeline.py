"""Where a long prompt stalls the streams: three generations streaming through one fleet of
benchmarks/pd_fleet.py (PD or aggregated, the same pinned engines), one long prompt sent beside
them, and every gap between two streamed tokens longer than twice the median, with when it
began (seconds after the first send) and when the long prompt's first token came.

    python benchmarks/pd_fleet_timeline.py pd            # ~2 min on 2 cores
    python benchmarks/pd_fleet_timeline.py aggregated --prompt-tokens 2500

The long prompt goes at 10 s; the generations (64-token prompts, --gen-tokens each) at 0, 1
and 2 s. Timings never fail anything: this prints.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from _machine import machine_line
from pd_fleet import SETUPS, VOCAB, Sent, send, start, stop_all, warm


def requests(args: argparse.Namespace) -> list[Sent]:
    rnd = random.Random(args.seed)
    ids = lambda n: [rnd.randrange(*VOCAB) for _ in range(n)]  # noqa: E731
    gens = [Sent(float(i), "gen", ids(64), args.gen_tokens) for i in range(3)]
    return [*gens, Sent(10.0, "prompt", ids(args.prompt_tokens), 8)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("setup", choices=SETUPS)
    p.add_argument("--prompt-tokens", type=int, default=2500)
    p.add_argument("--gen-tokens", type=int, default=300)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--cores", type=int, nargs=2, default=[0, 1], metavar=("A", "B"))
    p.add_argument("--seed", type=int, default=5)
    args = p.parse_args()
    print(machine_line())
    print(f"workload: 3 generations of {args.gen_tokens} tokens at 0/1/2 s, one "
          f"{args.prompt_tokens}-token prompt at 10 s, through {args.setup}", flush=True)  # fmt: skip
    reqs = requests(args)
    engines, router = start(args.setup, args)
    try:
        warm(args.setup, engines, router)
        with ThreadPoolExecutor(len(reqs)) as pool:
            t0 = time.perf_counter() + 0.5
            got = list(pool.map(lambda r: send(router.port, r, t0), reqs))
    finally:
        stop_all(engines, router)
    report(got, t0)


def report(got: list, t0: float) -> None:
    prompt = got[-1]
    first = f"{prompt.times[0] - t0:.1f} s" if prompt.times else "never"
    print(f"long prompt: first token at {first} (TTFT {prompt.ttft:.1f} s)")
    gaps = [(a - t0, b - a) for g in got[:-1] for a, b in zip(g.times, g.times[1:])]
    med = statistics.median(x for _, x in gaps)
    print(f"{len(gaps)} gaps, median {med * 1e3:.0f} ms; longer than twice that:")
    for at, x in sorted(gaps):
        if x > 2 * med:
            print(f"  {x * 1e3:>8.0f} ms from {at:.2f} s")


if __name__ == "__main__":
    main()
