"""How many requests each worker has been sent lately: decayed dispatch counts, which cache_aware
keeps within a slack of the mean by spilling the odd hit. Pure: no clock, no I/O."""

# Why counts of dispatches and not in-flight loads: in-flight counts swing with every stall and
# burst, while a static imbalance (four prefix groups that happen to draw 10% more traffic
# than another four) shows only in what was sent over hundreds of requests. Decaying per
# dispatch rather than per second keeps the router (wall time) and the simulator (virtual
# time) identical.

from __future__ import annotations

from collections.abc import Hashable, Sequence

_RESCALE_AT = 1e100


class DispatchShares:
    """Per worker, dispatches weighted by recency: each dispatch counts (1 - 1/window) times
    less than the next one, so about the last `window` dispatches matter. A worker that is new,
    or back after missing for more than window/16 dispatches, starts at the mean of the others,
    so that it neither attracts every spill nor sheds its own traffic."""

    def __init__(self, window: int = 4096) -> None:
        self.window = window
        self._growth = 1.0 / (1.0 - 1.0 / window)
        self._unit = 1.0  # what the next dispatch adds: growing it decays all the others
        self._dispatches = 0
        self._counts: dict[Hashable, float] = {}
        self._seen: dict[Hashable, int] = {}  # worker -> dispatches at its last sighting

    def observe(self, ids: Sequence[Hashable]) -> None:
        """`ids` are routable now."""
        seen, now = self._seen, self._dispatches
        returning = [w for w in ids if now - seen.get(w, -self.window) > self.window // 16]
        if returning:
            staying = [self._counts.get(w, 0.0) for w in ids if w not in returning]
            mean = sum(staying) / len(staying) if staying else None
            for w in returning:
                self._counts[w] = self._counts.get(w, 0.0) if mean is None else mean
        for w in ids:
            seen[w] = now

    def record(self, worker: Hashable) -> None:
        """One request was sent to `worker`."""
        self._counts[worker] = self._counts.get(worker, 0.0) + self._unit
        self._unit *= self._growth
        self._dispatches += 1
        self._seen[worker] = self._dispatches
        if self._unit > _RESCALE_AT:
            self._counts = {w: c / self._unit for w, c in self._counts.items()}
            self._unit = 1.0

    def count(self, worker: Hashable) -> float:
        """Recent dispatches to `worker`, each weighted (1 - 1/window) ** (dispatches since)."""
        return self._counts.get(worker, 0.0) / self._unit

    def excess(self, worker: Hashable, ids: Sequence[Hashable]) -> tuple[float, float]:
        """(count of `worker` minus the mean over `ids`, that mean)."""
        mean = sum(self.count(w) for w in ids) / len(ids)
        return self.count(worker) - mean, mean

    def forget(self, worker: Hashable) -> None:
        self._counts.pop(worker, None)
        self._seen.pop(worker, None)
