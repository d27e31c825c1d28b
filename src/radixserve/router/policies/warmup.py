"""Gradual warm-up of a worker that joins a fleet already under traffic (added, or back after
a crash with an empty cache). Pure: no clock, no I/O; `now` is passed in.

Why: cache_aware places a new prefix on the worker with the smallest tree among those not
busier than average, and a worker that just joined has the smallest tree and no load, only
because it is new: it drew 91% of the next 800 requests after a rejoin (smg: 25%), a herd that
swamps an engine that has just started (cold CUDA graphs, empty KV cache, JIT). Here, for
`secs` after it joins, its share of the new prefixes placed since it joined is capped: its fair
share (1/N) at first, rising linearly to no cap at the end of the warm-up. Hits on what it
already holds are not capped (they are its own traffic)."""

from __future__ import annotations

from collections.abc import Hashable


class WarmUp:
    """Counts new-prefix placements and the joiners' part of them."""

    def __init__(self, secs: float) -> None:
        self.secs = secs
        self.placed = 0  # new prefixes placed on any worker, ever
        # worker -> [joined at, `placed` when it joined, new prefixes it took since]
        self._joined: dict[Hashable, list[float]] = {}

    def join(self, worker: Hashable, now: float) -> None:
        """`worker` appeared; it warms up only if the fleet already had traffic (at start
        every worker is new, and none is new only because of that)."""
        if self.secs > 0 and self.placed:
            self._joined[worker] = [now, self.placed, 0]

    def forget(self, worker: Hashable) -> None:
        self._joined.pop(worker, None)

    def record_new(self, worker: Hashable) -> None:
        """A new prefix was placed on `worker`."""
        self.placed += 1
        entry = self._joined.get(worker)
        if entry is not None:
            entry[2] += 1

    def allows(self, worker: Hashable, now: float, fleet: int) -> bool:
        """Whether `worker` may take one more new prefix now."""
        entry = self._joined.get(worker)
        if entry is None:
            return True
        age = now - entry[0]
        if age >= self.secs:
            del self._joined[worker]
            return True
        cap = 1.0 / fleet + (1.0 - 1.0 / fleet) * age / self.secs
        return entry[2] < cap * (self.placed - entry[1] + 1)

    def active(self) -> bool:
        """Whether any worker is warming up (else allows() is True for all)."""
        return bool(self._joined)
