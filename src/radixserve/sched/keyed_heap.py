"""KeyedHeap: a priority queue of requests that can be re-keyed, and read in order without popping.

The waiting-queue policies keep their order in it, so a pass pays only for what it reads.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

from radixserve.sched.request import Req


class KeyedHeap:
    """Requests ordered by a unique key, with O(log n) put (add or re-key) and O(1) discard.

    Iteration yields live requests in key order *without popping them*: a small frontier heap
    walks the heap array (a child is never smaller than its parent), so taking the first k
    costs O(k log k) whatever the size. Stale entries are skipped and compacted away once they
    outnumber live ones, which keeps puts amortised O(log n); stale entries that reach the top
    are popped at once, because requests leave from the front (admitted in key order): left
    there, every pass would walk all of them until the next compaction.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, Req]] = []
        self._ver: dict[Req, int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._ver)

    def __contains__(self, req: Req) -> bool:
        return req in self._ver

    def put(self, req: Req, key: Any) -> None:
        self._next += 1
        self._ver[req] = self._next
        heapq.heappush(self._heap, (key, self._next, req))
        if len(self._heap) > 2 * len(self._ver) + 64:
            self._heap = [e for e in self._heap if self._ver.get(e[2]) == e[1]]
            heapq.heapify(self._heap)
        self._trim()

    def keys(self) -> dict[Req, Any]:
        """Every live request's current key (for integrity checks)."""
        ver = self._ver
        return {req: key for key, v, req in self._heap if ver.get(req) == v}

    def discard(self, req: Req) -> None:
        self._ver.pop(req, None)
        self._trim()

    def _trim(self) -> None:
        heap, ver = self._heap, self._ver
        while heap and ver.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)

    def __iter__(self) -> Iterator[Req]:
        heap, ver = self._heap, self._ver
        front = [(heap[0][0], heap[0][1], 0)] if heap else []
        while front:
            _, version, i = heapq.heappop(front)
            req = heap[i][2]
            if ver.get(req) == version:
                yield req
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(heap):
                    heapq.heappush(front, (heap[c][0], heap[c][1], c))
