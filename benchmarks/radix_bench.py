"""Radix cache match / insert / evict against SGLang 0.5.23's production tree, side by side.

A tree of 1,000 sequences of L tokens in 10 prefix groups (each group shares an L/2-token
prefix, each sequence has a unique L/2-token suffix), at L = 2,000 and 8,000. Rows: full-hit,
group-hit and miss matches, inserts (building the whole tree), eviction of one leaf of L/2
tokens, and one eviction of 100 such leaves; the evictions give the freed slots back to each
system's allocator. Each system gets its natural input, made outside the timing: ours the
token array a scheduled ``Req`` holds (``token_array``, converted once when the request is
made), SGLang the ``RadixKey(array('q'))`` its requests hold, and KV slots from its own
allocator (``array('q')`` / a torch tensor). Both sides hold arrays, so the natural rows are also
the arrays-on-both-sides comparison; the "[list]" row gives both a fresh Python list per call
instead (a caller that never converted: what radixserve's scheduler passed before issue 16).

Ours is the tree with host-tier support (issue 27) and no tier configured, as SGLang's is
without HiCache. The baseline is SGLang's ``UnifiedRadixCache`` on its Rust tree core
(``rust_tree_core``), measured in the same process, each repeat running the systems back to back on identical trees
(see benchmarks/_radix_baselines.py), and beside it the same cache on SGLang's pure-Python tree
core (the "py" columns); without sglang, a plain pure-Python radix tree. Our median of --repeats
with its min-max (the spread: evicting 100 long leaves moves megabytes, so it follows the
machine's memory traffic), the baselines' medians; CPU time by default, as the machine may be
shared (--clock wall for elapsed time).

    python benchmarks/radix_bench.py [--repeats 5] [--lengths 2000 8000] [--clock cpu|wall] [--ops evict]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from array import array
from collections.abc import Callable
from typing import Any

from _machine import machine_line
from _radix_baselines import Loop, Ours, SGLangPython, SGLangUnified, sglang_status

GROUPS, PER_GROUP = 10, 100
VOCAB = (257, 32000)  # CPython caches the ints -5..256; real token ids are mostly larger
EVICT_CALLS = 100  # single-leaf evictions timed together
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def fresh(tokens: list[int]) -> list[int]:
    """An equal list of new int objects, as a tokenizer would hand over for a new request."""
    return array("q", tokens).tolist()


def make_sequences(length: int, rng: random.Random) -> list[list[int]]:
    half = length // 2
    prefixes = [[rng.randrange(*VOCAB) for _ in range(half)] for _ in range(GROUPS)]
    return [
        fresh(p) + [rng.randrange(*VOCAB) for _ in range(half)]
        for p in prefixes
        for _ in range(PER_GROUP)
    ]


def make_queries(seqs: list[list[int]], rng: random.Random) -> dict[str, list[list[int]]]:
    half = len(seqs[0]) // 2
    other = (VOCAB[1], VOCAB[1] + 1000)  # ids that no cached sequence contains
    return {
        "full-hit": [fresh(s) for s in seqs],
        "group-hit": [fresh(s[:half]) + [rng.randrange(*other) for _ in range(half)] for s in seqs],
        "miss": [[rng.randrange(*other)] + fresh(s[1:]) for s in seqs],
    }


class Plan:
    """One system at one L: its natural keys (made once), a shared built tree for the match
    rows, and per row a setup (untimed: a tree to work on) and the timed call."""

    def __init__(self, factory: Callable[[int], Any], seqs: list[list[int]], queries: dict) -> None:
        self.factory, self.seqs, self.length = factory, seqs, len(seqs[0])
        self.capacity = len(seqs) * self.length + 1024
        self.probe = factory(16)
        self.keys = [self.probe.key(s) for s in seqs]
        self.queries = {k: [self.probe.key(q) for q in qs] for k, qs in queries.items()}
        self.lists = queries
        self._tree: Any = None

    def fresh_tree(self) -> tuple[Any, list[Any]]:
        """An empty tree and the slot values of every sequence, from its own allocator."""
        tree = self.factory(self.capacity)
        return tree, [tree.values(self.length) for _ in self.seqs]

    def built(self) -> Any:
        tree, values = self.fresh_tree()
        for k, v in zip(self.keys, values):
            tree.insert(k, v)
        return tree

    def shared(self) -> Any:
        if self._tree is None:
            self._tree = self.built()
            for q in self.queries["full-hit"]:  # a full hit ends in the query's own leaf
                assert self._tree.match_prefix(q) == self.length, "wrong full-hit length"
        return self._tree

    def ops(self) -> dict[str, tuple[Callable[[], Any], Callable[[Any], int]] | None]:
        q, half, convert = self.queries, self.length // 2, self.probe.key

        def matches(qs: list[Any], passes: int = 1, key_of: Callable | None = None) -> Any:
            def run(tree: Any) -> int:
                for _ in range(passes):
                    for x in qs:
                        tree.match_prefix(key_of(x) if key_of else x)
                return len(qs) * passes

            return (self.shared, run)

        def inserts(keys: list[Any], key_of: Callable | None = None) -> Any:
            def run(state: tuple[Any, list[Any]]) -> int:
                tree, values = state
                for k, v in zip(keys, values):
                    tree.insert(key_of(k) if key_of else k, v)
                return len(keys)

            return (self.fresh_tree, run)

        def evictions(calls: int, each: int) -> Any:
            def run(tree: Any) -> int:
                for _ in range(calls):
                    assert tree.evict(each) >= each, "evicted too little"
                return calls

            return (self.built, run) if getattr(self.probe, "evict", None) else None

        return {
            "full-hit match": matches(q["full-hit"]),
            "group-hit match": matches(q["group-hit"]),
            "miss match": matches(q["miss"], passes=20),  # a run long enough to time
            "insert": inserts(self.keys),
            "evict 1 x L/2": evictions(EVICT_CALLS, half),
            f"evict {EVICT_CALLS} x L/2": evictions(1, EVICT_CALLS * half),
            "full-hit [list]": matches(self.lists["full-hit"], key_of=convert),
        }


def measure(
    factories: dict[str, Callable[[int], Any]],
    length: int,
    repeats: int,
    clock: Callable,
    only: list[str] | None = None,
) -> dict[str, dict[str, list[float]]]:
    """Calls/s of every op for every system, one per repeat; each repeat runs the systems
    back to back (rotating which goes first), so a noisy neighbour slows them alike."""
    rng = random.Random(length)
    seqs = make_sequences(length, rng)
    queries = make_queries(seqs, rng)
    plans = {name: Plan(f, seqs, queries) for name, f in factories.items()}
    ops = {name: plan.ops() for name, plan in plans.items()}
    rates: dict[str, dict[str, list[float]]] = {name: {} for name in plans}
    names = list(plans)
    for op in [o for o in ops[names[0]] if not only or any(w in o for w in only)]:
        for rep in range(repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                row = ops[name][op]
                if row is None:
                    continue
                setup, run = row
                state = setup()
                gc.collect()
                t0 = clock()
                calls = run(state)
                rates[name].setdefault(op, []).append(calls / (clock() - t0))
                del state
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: this process's CPU time (steady on a shared machine); wall: elapsed")  # fmt: skip
    ap.add_argument("--sglang", choices=["auto", "on", "off"], default="auto",
                    help="run SGLang's UnifiedRadixCache side by side (auto: when it imports)")  # fmt: skip
    ap.add_argument(
        "--ops", nargs="+", metavar="OP", help="only the rows whose name has one of these"
    )
    args = ap.parse_args()
    print(machine_line())
    print(f"workload: {GROUPS} groups x {PER_GROUP} sequences of L tokens, L/2 shared per group; "
          f"natural inputs made outside the timing; median of {args.repeats}, {args.clock} time")  # fmt: skip
    factories: dict[str, Callable[[int], Any]] = {"ours": Ours}
    why = sglang_status() if args.sglang != "off" else "--sglang off"
    if why is None:
        import sglang

        factories["base"], factories["py"] = SGLangUnified, SGLangPython
        base = (
            f"SGLang {sglang.__version__} UnifiedRadixCache, Rust tree core (base) and Python (py)"
        )
    elif args.sglang == "on":
        raise SystemExit(f"--sglang on: {why}")
    else:
        factories["base"] = Loop
        base = f"a pure-Python radix tree ({why})"
    print(f"baseline, same process and repeats: {base}")
    print(f"{'op':<18} {'L':>5} {'calls/s':>11} {'min-max':>17} {'Mtok/s':>8} {'baseline/s':>11} "
          f"{'ratio':>7} {'py/s':>9} {'vs py':>6}")  # fmt: skip
    for length in args.lengths:
        got = measure(factories, length, args.repeats, CLOCKS[args.clock], args.ops)
        for op, rs in got["ours"].items():
            print(row(op, length, rs, got["base"].get(op), got.get("py", {}).get(op)))


def row(op: str, length: int, ours: list[float], base: list[float] | None,
        py: list[float] | None) -> str:  # fmt: skip
    """One op's line: our median calls/s and its spread, and the ratios to the baselines'."""
    r = statistics.median(ours)
    tok = r * (length if "hit" in op or "insert" in op or "miss" in op else 0) / 1e6
    out = f"{op:<18} {length:>5} {r:>11,.0f} {min(ours):>8,.0f}-{max(ours):<8,.0f} {tok:>8.1f}"
    for rates, width in ((base, 11), (py, 9)):
        ref = statistics.median(rates) if rates else None
        out += f" {ref:>{width},.0f} {r / ref:>6.2f}x" if ref else f" {'-':>{width}} {'-':>7}"
    return out


if __name__ == "__main__":
    main()
