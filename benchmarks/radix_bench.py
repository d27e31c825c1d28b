"""Radix cache match / insert throughput on a tree of 1,000 sequences in 10 prefix groups.

Each group shares an L/2-token prefix; each sequence has a unique L/2-token suffix. Prints
calls/s and tokens/s (median of --repeats runs) for full-hit, group-hit and miss matches and for
inserts, at L = 2,000 and 8,000.

Inputs are what a real caller passes: every sequence and every query is its own freshly built
list of fresh int objects (token ids > 256, above CPython's small-int cache), so no two share
an int object and comparisons cannot short-cut on identity; the queries are never the lists
that were inserted, and each call converts its list itself.

Rows marked [arr] hand the token ids over already in a C array of the tree's key type
(``RadixCache.key_typecode``), converted outside the timing: SGLang's RadixKey holds its ids
that way, so these rows are the like-for-like comparison with its figures; the other rows
include converting a Python list, which is what a caller holding a list pays.

Rows: "match" is match_prefix returning the length and the last node (what the scheduler's
prefix index uses, and what SGLang 0.5.23's match_prefix returns); "+slots" also reads the
result's slot list (what the KV manager does after an insert). The baseline, measured in the
same run on the same inputs (each repeat right after ours), is a plain pure-Python radix tree
that compares keys token by token in a Python loop (SGLang's radix cache before it moved to
slice compares, lists for values).
Times are this process's CPU time by default, as the machine may be shared (--clock wall for
elapsed time).

When the ``sglang`` package is importable, SGLang's own RadixCache (page size 1, built with
``RadixCache.create_simulated``) runs in the same repeats on the same inputs and the last
columns are measured against it; otherwise they are against the figures quoted in issue 2
(marked "q"). Its keys are ``RadixKey`` over ``array('q')``: the list rows convert each list
inside the timing (as ours do), the [arr] rows hand it the array; its slot values are torch
tensors made outside the timing. It has no "+slots" row (its MatchResult carries only the
length; the indices would need a walk and a torch.cat).

    python benchmarks/radix_bench.py [--repeats 5] [--lengths 2000 8000] [--clock cpu|wall]
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
from radixserve.cache.radix import RadixCache

GROUPS, PER_GROUP = 10, 100
VOCAB = (257, 32000)  # CPython caches the ints -5..256; real token ids are mostly larger
# SGLang 0.5.23's pure-Python RadixCache on this kind of machine (figures quoted in issue 2)
SGLANG_REF = {("full-hit match", 2000): 39_000, ("full-hit match", 8000): 23_500,
              ("insert", 2000): 29_000, ("full-hit [arr]", 2000): 39_000,
              ("full-hit [arr]", 8000): 23_500, ("insert [arr]", 2000): 29_000}  # fmt: skip


def fresh(tokens: list[int]) -> list[int]:
    """An equal list of new int objects, as a tokenizer would hand over for a new request."""
    return array("q", tokens).tolist()


# -- the baseline: a plain radix tree, keys compared token by token -----------------------------
class _LoopNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "hits")

    def __init__(self, key: list[int], value: list[int], parent: _LoopNode | None) -> None:
        self.children: dict[int, _LoopNode] = {}
        self.parent, self.key, self.value = parent, key, value
        self.lock_ref, self.last_access, self.hits = 0, 0, 0


class _LoopMatch:
    __slots__ = ("last_node", "length")

    def __init__(self, last_node: _LoopNode, length: int) -> None:
        self.last_node, self.length = last_node, length

    @property
    def slots(self) -> list[int]:
        parts, node = [], self.last_node
        while node.parent is not None:
            parts.append(node.value)
            node = node.parent
        return [s for part in reversed(parts) for s in part]


def _loop_match(key: list[int], tokens: list[int]) -> int:
    i = 0
    for a, b in zip(key, tokens):
        if a != b:
            break
        i += 1
    return i


class LoopRadix:
    """SGLang's RadixCache algorithm (page size 1) with Python lists for keys and values."""

    def __init__(self) -> None:
        self.root = _LoopNode([], [], None)
        self.tick = 0

    def match_prefix(self, key: list[int]) -> _LoopMatch:
        self.tick += 1
        node, length = self.root, 0
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access, child.hits = self.tick, child.hits + 1
            n = _loop_match(child.key, key)
            length += n
            if n < len(child.key):
                node = self._split(child, n)
                break
            node, key = child, key[n:]
        return _LoopMatch(node, length)

    def insert(self, key: list[int], value: list[int]) -> int:
        self.tick += 1
        node, total = self.root, 0
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access = self.tick
            n = _loop_match(child.key, key)
            total += n
            key, value = key[n:], value[n:]
            if n < len(child.key):
                child = self._split(child, n)
            node = child
        if key:
            leaf = _LoopNode(key, value, node)
            node.children[key[0]] = leaf
        return total

    def _split(self, child: _LoopNode, n: int) -> _LoopNode:
        parent = child.parent
        assert parent is not None
        upper = _LoopNode(child.key[:n], child.value[:n], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.hits = child.hits
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper


class SGLangRadix:
    """SGLang's own RadixCache behind this benchmark's calls (only when sglang is importable)."""

    key_typecode = "q"  # RadixKey holds its token ids as array('q')

    def __init__(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache as SGLangCache
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self._cache = SGLangCache.create_simulated(page_size=1)
        self._key, self._match, self._insert = RadixKey, MatchPrefixParams, InsertParams

    @staticmethod
    def prepare_values(values: list[list[int]]) -> list[Any]:
        import torch

        return [torch.tensor(v, dtype=torch.int64) for v in values]

    def _radix_key(self, tokens: Any) -> Any:
        ids = tokens if type(tokens) is array else array("q", tokens)
        return self._key(ids)

    def match_prefix(self, tokens: Any) -> Any:
        got = self._cache.match_prefix(self._match(key=self._radix_key(tokens)))
        return _SGLangMatch(got.device_prefix_len)

    def insert(self, tokens: Any, values: Any) -> int:
        return self._cache.insert(
            self._insert(key=self._radix_key(tokens), value=values)
        ).prefix_len


class _SGLangMatch:
    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length


def sglang_available() -> bool:
    try:
        SGLangRadix()
    except Exception:  # not installed, or its import chain fails here
        return False
    return True


# -- workload ---------------------------------------------------------------------------------
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


def check_inputs(seqs: list[list[int]], queries: dict[str, list[list[int]]]) -> None:
    """No query, and no two sequences of a group, share an int object (so no identity hits)."""
    seen = {id(x) for s in seqs for x in s}
    assert len(seen) == sum(len(s) for s in seqs), "sequences share int objects"
    for qs in queries.values():
        assert not any(id(x) in seen for q in qs for x in q), "a query shares ints with the tree"


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(
    factories: dict[str, Callable[[], Any]], length: int, repeats: int, clock: Callable[[], float]
) -> dict[str, dict[str, float]]:
    """Median calls/s of every op for every implementation; each repeat runs the
    implementations back to back, so a noisy neighbour slows them alike."""
    rng = random.Random(length)
    seqs = make_sequences(length, rng)
    slots = [list(range(i * length, (i + 1) * length)) for i in range(len(seqs))]
    queries = make_queries(seqs, rng)
    check_inputs(seqs, queries)
    full, group, miss = queries["full-hit"], queries["group-hit"], queries["miss"]

    def values_for(factory: Callable[[], Any]) -> list[Any]:
        prepare = getattr(factory, "prepare_values", None)
        return prepare(slots) if prepare else slots

    def build(factory: Callable[[], Any], values: list[Any]) -> Any:
        cache = factory()
        for s, v in zip(seqs, values):
            cache.insert(s, v)
        return cache

    built: list[Any] = []  # each run's tree is freed after its timing, not inside the next

    def plan(factory: Callable[[], Any]) -> dict[str, tuple[Callable[[], int], Callable[[], None]]]:
        values = values_for(factory)  # made once, outside every timing
        cache = build(factory, values)
        for q, v in zip(full, slots):  # a full hit ends in the query's own leaf
            got = cache.match_prefix(q)
            assert got.length == length, "full-hit match returned a wrong length"
            if hasattr(got, "slots"):
                assert got.slots[-1] == v[-1], "full-hit match returned wrong slots"

        def matches(qs: list[list[int]], passes: int = 1) -> Callable[[], int]:
            return lambda: sum(
                1 for _ in range(passes) for q in qs if cache.match_prefix(q).length >= 0
            )

        def matches_with_slots(qs: list[list[int]]) -> Callable[[], int]:
            return lambda: sum(1 for q in qs if len(cache.match_prefix(q).slots) >= 0)

        def inserts() -> int:
            built.append(build(factory, values))
            return len(seqs)

        # the same calls with token ids already in a C array of the tree's key type (as
        # SGLang's RadixKey holds them): the per-token list conversion is not in the timing
        code = getattr(cache, "key_typecode", None)
        as_array = (lambda qs: [array(code, q) for q in qs]) if code else (lambda qs: qs)
        full_arr, seqs_arr = as_array(full), as_array(seqs)

        def inserts_arr() -> int:
            fresh_cache = factory()
            for s, v in zip(seqs_arr, values):
                fresh_cache.insert(s, v)
            built.append(fresh_cache)
            return len(seqs)

        keep = built.clear
        with_slots = hasattr(cache.match_prefix(full[0]), "slots")
        return {
            "full-hit match": (matches(full), keep),
            "full-hit +slots": (matches_with_slots(full) if with_slots else None, keep),
            "group-hit match": (matches(group), keep),
            "miss match": (matches(miss, passes=20), keep),  # a run long enough to time
            "insert": (inserts, keep),
            "full-hit [arr]": (matches(full_arr), keep),
            "insert [arr]": (inserts_arr, keep),
        }

    plans = {name: plan(factory) for name, factory in factories.items()}
    rates: dict[str, dict[str, list[float]]] = {name: {} for name in plans}
    for op in plans[next(iter(plans))]:
        for _ in range(repeats):
            for name, ops in plans.items():
                fn, after = ops[op]
                if fn is None:
                    continue
                gc.collect()
                t0 = clock()
                calls = fn()
                rates[name].setdefault(op, []).append(calls / (clock() - t0))
                after()
    return {
        name: {op: statistics.median(r) for op, r in ops.items()} for name, ops in rates.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: this process's CPU time (steady on a shared machine); wall: elapsed")  # fmt: skip
    ap.add_argument("--sglang", choices=["auto", "on", "off"], default="auto",
                    help="run SGLang's RadixCache side by side (auto: when it imports)")  # fmt: skip
    args = ap.parse_args()
    clock = CLOCKS[args.clock]
    print(machine_line())
    print(f"workload: {GROUPS} groups x {PER_GROUP} sequences of L tokens, L/2 shared per group; "
          f"fresh int objects in every query; median of {args.repeats} runs, {args.clock} time")  # fmt: skip
    factories: dict[str, Callable[[], Any]] = {"ours": RadixCache, "base": LoopRadix}
    if args.sglang != "off" and sglang_available():
        import sglang

        factories["sglang"] = SGLangRadix
        print(f"SGLang {sglang.__version__} RadixCache measured in the same repeats")
    elif args.sglang == "on":
        raise SystemExit("--sglang on: the sglang package does not import here")
    else:
        print("SGLang not importable: 'vs SGLang' uses the figures quoted in issue 2 (q)")
    print(f"{'op':<16} {'L':>5} {'calls/s':>10} {'Mtok/s':>8} {'loop baseline':>14} "
          f"{'ratio':>6} {'SGLang':>9} {'vs SGLang':>9}")  # fmt: skip
    for length in args.lengths:
        got = measure(factories, length, args.repeats, clock)
        ours, base, sgl = got["ours"], got["base"], got.get("sglang")
        for op, r in ours.items():
            if sgl is not None:
                ref, mark = sgl.get(op), ""
            else:
                ref, mark = SGLANG_REF.get((op, length)), " q"
            ref_s = f"{ref:,.0f}{mark}" if ref else "-"
            vs = f"{r / ref:.2f}x" if ref else "-"
            print(f"{op:<16} {length:>5} {r:>10,.0f} {r * length / 1e6:>8.1f} {base[op]:>14,.0f} "
                  f"{r / base[op]:>5.1f}x {ref_s:>9} {vs:>9}")  # fmt: skip


if __name__ == "__main__":
    main()
