"""Eviction order for the radix cache: the policies, and the heap of evictable leaves.

It owns which leaf goes first (``POLICIES``) and a heap that yields it in O(log n), kept in step
with the tree by the cache's calls. Pure Python: no torch, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The policies. A key is computed from a node's counters; the smallest key is evicted first.
#   lru       least recently used (last access tick)
#   lfu       fewest hits, then least recently used
#   fifo      first inserted first
#   mru       most recently used first (SGLang's mru: for scans that never come back)
#   filo      last inserted first (SGLang's filo)
#   priority  lowest request priority first, then lru; a node's priority is the highest
#             priority of the requests that inserted it (SGLang's rule)
#   hit-benefit  least decayed hit benefit first: every hit through a node (a match that
#             reuses it) adds the node's token count, weighted 2**(tick / half-life), so the
#             benefit halves every BENEFIT_HALF_LIFE ticks; a node's hits include the hits of
#             every match that went on below it, so a leaf's benefit is its whole subtree's
#             and an inner node outlives its children. Waiting requests are matched when they
#             are queued (the scheduler's prefix index), so the prefixes that LPM will admit
#             next carry the benefit of those matches and are the last to go: admission and
#             eviction pull the same way, where lru evicts a prefix the queue is about to use
#             if it was touched less recently than a finished one-off.
# A policy is "monotone" when a node's key never falls while it waits as a leaf: then an
# access does not touch the heap at all; a stale entry is re-keyed when it reaches the top.
BENEFIT_HALF_LIFE = 4096.0  # ticks (one per match or insert; a request makes about four)


def _log2_add(a: float, b: float) -> float:
    """log2(2**a + 2**b), without overflow (benefits are kept as base-2 logs)."""
    if a < b:
        a, b = b, a
    return a if b == -math.inf else a + math.log2(1.0 + 2.0 ** (b - a))


def benefit_key(node: Any) -> float:
    n = len(node.key)
    return node.benefit + math.log2(n) if n else -math.inf


@dataclass(frozen=True, slots=True)
class Policy:
    key: Callable[[Any], Any]
    monotone: bool  # the key never falls while the node is a leaf (only on split, for one)


POLICIES: dict[str, Policy] = {
    "lru": Policy(lambda n: n.last_access, True),
    "lfu": Policy(lambda n: (n.hits, n.last_access), True),
    "fifo": Policy(lambda n: n.born, True),
    "mru": Policy(lambda n: -n.last_access, False),
    "filo": Policy(lambda n: -n.born, True),
    "priority": Policy(lambda n: (n.priority, n.last_access), True),
    "hit-benefit": Policy(benefit_key, True),
}


def add_hit(node: Any, tick: int) -> None:
    """Record one hit of ``node`` at ``tick`` in its decayed benefit (hit-benefit policy)."""
    node.benefit = _log2_add(node.benefit, tick / BENEFIT_HALF_LIFE)


class EvictionHeap:
    """The evictable leaves, smallest policy key on top; O(log n) a change, lazy deletion.

    Each node holds ``hseq``: the id of its one live entry, or None when it has none. An entry
    whose id is not its node's ``hseq`` is stale and dropped when it surfaces; a live entry
    whose node is no longer an evictable leaf (locked, or it got children) is dropped too, and
    the cache offers the node again when it becomes one (``offer``). Rebuilt when stale entries
    outnumber live ones, so the heap stays within twice the number of nodes.
    """

    def __init__(self, policy: Policy) -> None:
        self.key = policy.key
        self.monotone = policy.monotone
        self._heap: list[tuple[Any, int, Any]] = []
        self._seq = 0
        self._stale = 0

    def __len__(self) -> int:
        return len(self._heap) - self._stale

    def offer(self, node: Any) -> None:
        """``node`` became an evictable leaf (new, unlocked, or its last child went)."""
        if node.hseq is None:
            self._push(node)

    def rekey(self, node: Any) -> None:
        """``node``'s key may have fallen (an mru access, a split): a fresh entry if queued."""
        if node.hseq is not None:
            self._stale += 1
            self._push(node)

    def drop(self, node: Any) -> None:
        """``node`` left the tree: its entry is stale."""
        if node.hseq is not None:
            node.hseq = None
            self._stale += 1

    def _push(self, node: Any) -> None:
        self._seq += 1
        node.hseq = self._seq
        heapq.heappush(self._heap, (self.key(node), self._seq, node))
        if self._stale > 1024 and self._stale > len(self._heap) // 2:
            self._rebuild()

    def pop(self, evictable: Callable[[Any], bool]) -> Any | None:
        """The evictable leaf with the smallest current key, out of the heap (None: none)."""
        heap, key = self._heap, self.key
        while heap:
            k, seq, node = heap[0]
            if seq != node.hseq:
                heapq.heappop(heap)
                self._stale -= 1
                continue
            if not evictable(node):
                heapq.heappop(heap)
                node.hseq = None
                continue
            cur = key(node)
            if cur != k:  # raised since it was queued (monotone): back in at its new place
                self._seq += 1
                node.hseq = self._seq
                heapq.heapreplace(heap, (cur, self._seq, node))
                continue
            heapq.heappop(heap)
            node.hseq = None
            return node
        return None

    def _rebuild(self) -> None:
        self._heap = [e for e in self._heap if e[1] == e[2].hseq]
        heapq.heapify(self._heap)
        self._stale = 0

    def check(self, leaves: list[Any]) -> None:
        """Recount: every evictable leaf has exactly one live entry, keyed at or below its
        current key (equal for a policy that is not monotone), and the stale count is exact."""
        live = [e for e in self._heap if e[1] == e[2].hseq]
        assert len(live) + self._stale == len(self._heap), "stale entries miscounted"
        assert len({id(e[2]) for e in live}) == len(live), "a node has two live entries"
        for node in leaves:
            assert node.hseq is not None, f"evictable leaf {node!r} is not in the heap"
        for k, _, node in live:
            cur = self.key(node)
            assert k <= cur if self.monotone else k == cur, f"{node!r}: heap key {k} vs {cur}"
