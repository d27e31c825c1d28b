"""The best prefix hit rate a workload allows: the share of prompt tokens (or of a trace's
blocks) that one unbounded cache already holds when the requests arrive in order."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

from radixserve.sim.trace_replay import TraceRecord
from radixserve.sim.workload_request import WorkloadRequest


def ideal_prefix_hit_rate(
    requests: Iterable[WorkloadRequest],
    page_size: int = 1,
    outputs: Callable[[WorkloadRequest], list[int]] | None = None,
) -> float:
    """Share of prompt tokens that one unbounded cache already holds, in arrival order: the
    best any placement can reach.

    A token is a hit when the prompt up to and including it (in whole pages) was a prefix of
    an earlier cached sequence, except a prompt's last token, which an engine always computes.
    Without ``outputs`` only prompts are cached, so multi-turn replies count as misses; with
    it (what the engine generates for a request), each reply but its last token is cached too.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    seen: list[list[int]] = []  # earlier cached sequences, sorted
    hit = total = 0
    for req in sorted(requests, key=lambda r: r.arrival_s):
        ids = req.input_ids
        i = bisect.bisect_left(seen, ids)
        # the earlier sequence sharing the longest prefix is a sorted-order neighbour
        best = max(
            (_common_prefix(ids, seen[j]) for j in (i - 1, i) if 0 <= j < len(seen)), default=0
        )
        best = min(best, len(ids) - 1)
        hit += best - best % page_size
        total += len(ids)
        seen.insert(i, ids)
        if outputs is not None:
            out = outputs(req)
            if len(out) > 1:
                bisect.insort(seen, ids + out[:-1])  # the last token's KV is never computed
    return hit / total if total else 0.0


def _common_prefix(a: list[int], b: list[int]) -> int:
    # binary search on slice equality: the comparisons run in C, not token by token in Python
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def block_hit_rate(requests: Iterable[WorkloadRequest | TraceRecord]) -> float:
    """Share of prompt blocks (hash ids) that an unbounded cache already holds, in order.

    Blocks hit only as a prefix: after a request's first unseen block, the rest are misses.
    """
    seen: set[int] = set()
    hit = total = 0
    for req in requests:
        if not req.hash_ids:
            raise ValueError("block_hit_rate needs requests with hash_ids (trace replay)")
        n = 0
        while n < len(req.hash_ids) and req.hash_ids[n] in seen:
            n += 1
        hit += n
        total += len(req.hash_ids)
        seen.update(req.hash_ids)
    return hit / total if total else 0.0
