"""The wrappers around a waiting-queue order: priority levels (--enable-priority-scheduling)
and bounded waiting (--max-wait-ms). ``make_policy`` in sched/policy.py applies them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from radixserve.config import SchedulerConfig
from radixserve.sched.policy_base import PassContext, WaitingPolicy
from radixserve.sched.request import Req


class PriorityQueues(WaitingPolicy):
    """--enable-priority-scheduling: one inner queue per priority value, larger values first;
    the configured policy orders each level."""

    def __init__(self, config: SchedulerConfig, make: Callable[[], WaitingPolicy]) -> None:
        super().__init__(config)
        self._make = make
        self._levels: dict[int, WaitingPolicy] = {}
        self._size = 0
        self.cache_aware = make().cache_aware

    def __len__(self) -> int:
        return self._size

    def add(self, req: Req) -> None:
        if req.priority not in self._levels:
            self._levels[req.priority] = self._make()
        self._levels[req.priority].add(req)
        self._size += 1

    def remove(self, req: Req) -> None:
        level = self._levels[req.priority]
        level.remove(req)
        self._size -= 1
        if not len(level):
            del self._levels[req.priority]

    def update(self, req: Req, old_node: Any) -> None:
        self._levels[req.priority].update(req, old_node)

    def on_split(self, upper: Any, lower: Any) -> None:
        for level in self._levels.values():
            level.on_split(upper, lower)

    def order(self, ctx: PassContext) -> Iterator[Req]:
        for p in sorted(self._levels, reverse=True):
            yield from self._levels[p].order(ctx)

    def check(self, waiting: list[Req]) -> None:
        super().check(waiting)
        for p, level in self._levels.items():
            level.check([r for r in waiting if r.priority == p])


class BoundedWait(WaitingPolicy):
    """--max-wait-ms: requests that have waited at least ``max_wait_s`` come first, oldest
    first; the rest follow in the inner policy's order. 0 gives FCFS, None pure inner order.
    Aged requests are found at the front of an arrival-ordered dict, so the check costs one
    look per aged request plus one."""

    def __init__(self, inner: WaitingPolicy, max_wait_s: float, clock: Callable[[], float]):
        super().__init__(inner.config)
        self.inner, self.max_wait_s, self.clock = inner, max_wait_s, clock
        self._fifo: dict[Req, None] = {}  # queue-entry order, so queued_at never decreases
        self.cache_aware = inner.cache_aware

    def __len__(self) -> int:
        return len(self._fifo)

    def add(self, req: Req) -> None:
        self._fifo[req] = None
        self.inner.add(req)

    def remove(self, req: Req) -> None:
        del self._fifo[req]
        self.inner.remove(req)

    def update(self, req: Req, old_node: Any) -> None:
        self.inner.update(req, old_node)

    def on_split(self, upper: Any, lower: Any) -> None:
        self.inner.on_split(upper, lower)

    def check(self, waiting: list[Req]) -> None:
        super().check(waiting)
        self.inner.check(waiting)

    def order(self, ctx: PassContext) -> Iterator[Req]:
        line = self.clock() - self.max_wait_s  # queued at or before this: aged
        for req in self._fifo:
            if req.queued_at > line:
                break
            yield req
        for req in self.inner.order(ctx):
            if req.queued_at > line:
                yield req
