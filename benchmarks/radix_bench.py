"""Radix cache match / insert throughput on a tree of 1,000 sequences in 10 prefix groups.

Each group shares an L/2-token prefix; each sequence has a unique L/2-token suffix. Prints
calls/s and tokens/s (median of --repeats runs) for full-hit, group-hit and miss matches and for
inserts, at L = 2,000 and 8,000. The baseline, measured in the same run, is the same tree with
keys compared token by token in a Python loop (how a plain pure-Python radix tree compares them).

    python benchmarks/radix_bench.py [--repeats 5] [--lengths 2000 8000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

import radixserve.cache.radix as radix
from _machine import machine_line
from radixserve.cache.radix import RadixCache

GROUPS, PER_GROUP = 10, 100
# SGLang 0.5.23's pure-Python RadixCache on this kind of machine (figures quoted in issue 2)
SGLANG_REF = {("full-hit match", 2000): 39_000, ("full-hit match", 8000): 23_500,
              ("insert", 2000): 29_000}  # fmt: skip


def loop_common_len(a: list[int], b: Sequence[int], start: int, end: int) -> int:
    n = min(len(a), end - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


def make_sequences(length: int, rng: random.Random) -> list[list[int]]:
    half = length // 2
    prefixes = [[rng.randrange(32000) for _ in range(half)] for _ in range(GROUPS)]
    return [
        p + [rng.randrange(32000) for _ in range(half)] for p in prefixes for _ in range(PER_GROUP)
    ]


def build(seqs: list[list[int]], slots: list[list[int]]) -> RadixCache:
    cache = RadixCache()
    for s, v in zip(seqs, slots):
        cache.insert(s, v)
    return cache


def rate(fn: Callable[[], int], repeats: int) -> float:
    """Median calls/s of ``fn`` (which returns how many calls it made)."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        calls = fn()
        rates.append(calls / (time.perf_counter() - t0))
    return statistics.median(rates)


def measure(length: int, repeats: int) -> dict[str, float]:
    rng = random.Random(length)
    seqs = make_sequences(length, rng)
    slots = [list(range(i * length, (i + 1) * length)) for i in range(len(seqs))]
    cache = build(seqs, slots)
    half = length // 2
    group_hits = [s[:half] + [32001] * half for s in seqs[::PER_GROUP]] * PER_GROUP
    misses = [[32002] + s[1:] for s in seqs]

    def matches(queries: list[list[int]]) -> Callable[[], int]:
        return lambda: sum(1 for q in queries if cache.match_prefix(q) is not None)

    def inserts() -> int:
        build(seqs, slots)
        return len(seqs)

    return {
        "full-hit match": rate(matches(seqs), repeats),
        "group-hit match": rate(matches(group_hits), repeats),
        "miss match": rate(matches(misses), repeats),
        "insert": rate(inserts, repeats),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    args = ap.parse_args()
    print(machine_line())
    print(f"workload: {GROUPS} groups x {PER_GROUP} sequences of L tokens, L/2 shared per group; "
          f"median of {args.repeats} runs")  # fmt: skip
    print(f"{'op':<16} {'L':>5} {'calls/s':>10} {'Mtok/s':>8} {'loop baseline':>14} "
          f"{'ratio':>6} {'vs SGLang':>9}")  # fmt: skip
    fast_len = radix._common_len
    for length in args.lengths:
        ours = measure(length, args.repeats)
        radix._common_len = loop_common_len
        base = measure(length, args.repeats)
        radix._common_len = fast_len
        for op, r in ours.items():
            ref = SGLANG_REF.get((op, length))
            vs = f"{r / ref:.2f}x" if ref else "-"
            print(f"{op:<16} {length:>5} {r:>10,.0f} {r * length / 1e6:>8.1f} {base[op]:>14,.0f} "
                  f"{r / base[op]:>5.1f}x {vs:>9}")  # fmt: skip


if __name__ == "__main__":
    main()
