"""Admission control at the router's front door: at most `limit` inference requests in flight,
up to `queue_size` more waiting (first come, first served) for at most `timeout` seconds, and
the rest refused at once (503 with Retry-After) instead of queueing without bound."""

from __future__ import annotations

import asyncio
from collections import deque


class Admission:
    """Slots for requests in flight; `limit` 0 admits everything."""

    def __init__(self, limit: int, queue_size: int, timeout: float) -> None:
        self.limit, self.queue_size, self.timeout = limit, queue_size, timeout
        self.active, self.rejected = 0, 0
        self.waiting: deque[asyncio.Future[None]] = deque()

    def try_acquire(self) -> bool:
        """Take a free slot without waiting (no coroutine: the common case is cheap)."""
        if self.limit <= 0 or (self.active < self.limit and not self.waiting):
            self.active += 1
            return True
        return False

    async def acquire(self) -> bool:
        """Take a slot, waiting in the queue if there is room; False when refused."""
        if self.try_acquire():
            return True
        if len(self.waiting) >= self.queue_size:
            self.rejected += 1
            return False
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if turn.done() and not turn.cancelled():
                self.release()  # the slot was handed over just as we gave up: pass it on
            else:
                turn.cancel()
                self.waiting.remove(turn)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.rejected += 1
            return False
        return True

    def release(self) -> None:
        """Give the slot to the longest waiter, or free it."""
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # `active` stays: the slot changes hands
                return
        self.active -= 1

    @property
    def queued(self) -> int:
        return len(self.waiting)
