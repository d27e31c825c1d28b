"""The kv-indexer's index: a BlockIndex whose truth lives in Redis (schema: kvindex/redis_store.py).
Owns the mirror of what each worker holds, the per-batch diffs, and their ordered writing."""

# Why a mirror: keys, contiguity, orphans, media and block-size resets must mean in Redis exactly
# what they mean in the router's in-memory index, so the in-memory index computes them and this
# class only turns each batch's change into Redis writes. `apply` stays synchronous (the
# subscribers call it, as they call the in-memory index) and queues the diff; one task writes
# the queue in order, one atomic write per batch. When Redis fails or restarts empty, the mirror
# is the truth: every worker is rewritten in full once Redis answers again.

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.router.kvindex.block_index import (
    KEY_ALGORITHM,
    BlockIndex,
    BlockKey,
    InMemoryIndex,
    WorkerId,
)
from radixserve.router.kvindex.event_format import AllBlocksCleared, EngineHash, Event
from radixserve.router.kvindex.redis_store import BlockDiff, RedisIndexStore, WorkerEntry, block_id

log = logging.getLogger("radixserve.kv_indexer")
FULL_REWRITE_CHUNK = 20_000  # blocks per pipeline when a worker is rewritten in full
# Batches that queued up while a write was in flight go in one transaction: one round trip for
# many batches under a burst, and still never part of a batch visible to a reader.
MAX_BATCHES_PER_WRITE = 64


class _Mirror(InMemoryIndex):
    """The in-memory index, with a look at one worker's state for diffing."""

    def state(self, worker: WorkerId) -> Any:
        return self._workers.get(worker)


@dataclass(slots=True)
class _Op:
    worker: str
    diff: BlockDiff | None  # None: forget the worker in Redis
    block_size: int = 0


class RedisIndexWriter(BlockIndex):
    """Writers call `apply` / `drop_worker` as on InMemoryIndex; `run()` (a task) writes Redis.
    Reads answer from the mirror: the same answers routers get from Redis once it is written."""

    def __init__(self, store: RedisIndexStore, retry_secs: float = 0.5) -> None:
        self.store, self.retry_secs = store, retry_secs
        self.mirror = _Mirror()
        self.stats = self.mirror.stats
        self.ops: deque[_Op] = deque()
        self.entries: dict[str, WorkerEntry] = {}
        self.batches_written = self.write_errors = self.rewrites = 0
        self._wake = asyncio.Event()
        self._run_id = ""
        self._checked_at = 0.0
        self.redis_ok = False

    # ----- BlockIndex -----

    def apply(self, worker: WorkerId, events: Iterable[Event]) -> None:
        events = list(events)
        before = self.mirror.state(worker)
        touched = _touched(events)
        old = {eh: before.by_engine.get(eh) for eh in touched} if before is not None else {}
        self.mirror.apply(worker, events)
        after = self.mirror.state(worker)
        if after is None:  # cleared and nothing since: unknown, as in memory
            if before is not None:
                self._forget(worker)
        elif after is not before:  # first seen, or cleared, or reset by a new block size
            self._queue_full(worker, after)
        else:
            self._queue(worker, _diff(after, old, touched))

    def drop_worker(self, worker: WorkerId) -> None:
        """Unknown from now on: nothing of it stays in Redis (blocks nor registration)."""
        self.mirror.drop_worker(worker)
        self._forget(worker)

    def replace(self, worker: WorkerId, events: Iterable[Event]) -> None:
        """Everything `worker` holds is `events` (a snapshot): one transaction swaps it in."""
        self.mirror.drop_worker(worker)
        self.mirror.apply(worker, events)
        state = self.mirror.state(worker)
        if state is None:
            self._forget(worker)
        else:
            self._queue_full(worker, state)

    def _queue_full(self, worker: WorkerId, state: Any) -> None:
        for diff in _chunks(_full_diff(state)):
            self._queue(worker, diff)

    def _forget(self, worker: WorkerId) -> None:
        self.ops.append(_Op(str(worker), None))
        self._wake.set()

    def block_size(self, worker: WorkerId) -> int | None:
        return self.mirror.block_size(worker)

    def prefix_tokens(
        self, workers: Iterable[WorkerId], keys_for: Callable[[int], Sequence[BlockKey]]
    ) -> dict[WorkerId, int]:
        return self.mirror.prefix_tokens(workers, keys_for)

    def blocks(self) -> dict[WorkerId, int]:
        return self.mirror.blocks()

    def _queue(self, worker: WorkerId, diff: BlockDiff) -> None:
        if diff:
            size = self.mirror.block_size(worker) or 0
            self.ops.append(_Op(str(worker), diff, size))
            self._wake.set()

    # ----- writing -----

    async def run(self) -> None:
        """Write queued diffs in order until cancelled; survive Redis going away."""
        while True:
            try:
                await self._check_same_redis()
                if not self.ops:
                    self._wake.clear()
                    await self._idle()
                    continue
                done = await self._write_next()
                for _ in range(done):
                    self.ops.popleft()
                self.batches_written += done
            except Exception as exc:  # any Redis error: the op stays queued
                self._failed(exc)
                await asyncio.sleep(self.retry_secs)

    async def flushed(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is in Redis; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self.ops or not self.redis_ok) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return not self.ops and self.redis_ok

    async def _idle(self) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), 1.0)
        except asyncio.TimeoutError:
            pass

    def _failed(self, exc: Exception) -> None:
        if self.redis_ok or not self.write_errors:
            log.warning("Redis write failed (%s); retrying, the mirror keeps the truth", exc)
        self.write_errors += 1
        self.redis_ok = False

    async def _check_same_redis(self) -> None:
        """A Redis that restarted (a new run id) lost our entries: rewrite every worker. Looked
        at after any failure and every second (the client reconnects by itself)."""
        now = asyncio.get_running_loop().time()
        if self.redis_ok and now - self._checked_at < 1.0:
            return
        self._checked_at = now
        run_id = str((await self.store.client.info("server")).get("run_id", ""))
        if self._run_id and run_id != self._run_id:
            log.warning("Redis restarted (run id %s): rewriting the index", run_id)
            await self.rewrite_all()
        self._run_id, self.redis_ok = run_id, True

    async def rewrite_all(self) -> None:
        """Make an empty Redis say exactly what the mirror says, worker by worker."""
        self.rewrites += 1
        self.ops.clear()  # superseded; diffs queued during the rewrite are idempotent on top
        self.entries.clear()  # worker numbers were lost with the data
        await self.store.clear_prefix()  # anything written since the restart, numbers unknown
        for url in list(self.mirror.blocks()):
            state = self.mirror.state(url)
            entry = await self._entry(url, self.mirror.block_size(url) or 0)
            for diff in _chunks(_full_diff(state)):
                await self.store.write(entry, diff)

    async def _write_next(self) -> int:
        """Write the oldest queued op, with the diffs queued after it of already registered
        workers (up to MAX_BATCHES_PER_WRITE) in the same transaction; returns how many."""
        op = self.ops[0]
        if op.diff is None:
            self.entries.pop(op.worker, None)
            await self.store.drop(op.worker)
            return 1
        group = [(await self._entry(op.worker, op.block_size), op.diff)]
        for nxt in itertools.islice(self.ops, 1, MAX_BATCHES_PER_WRITE):
            entry = self.entries.get(nxt.worker)
            if nxt.diff is None or entry is None or entry.block_size != nxt.block_size:
                break  # a drop or a (re)registration goes on its own
            group.append((entry, nxt.diff))
        await self.store.write_many(group)
        return len(group)

    async def _entry(self, url: str, block_size: int) -> WorkerEntry:
        entry = self.entries.get(url)
        if entry is None or (block_size and entry.block_size != block_size):
            entry = await self.store.register(url, block_size, KEY_ALGORITHM)
            self.entries[url] = entry
        return entry


def _touched(events: Sequence[Event]) -> list[EngineHash]:
    return [h for e in events if not isinstance(e, AllBlocksCleared) for h in e.block_hashes]


def _h(engine_hash: EngineHash) -> str:
    """An engine hash as a field of ``P:m:<n>``: decimal, or hex for bytes (and for the rare
    string hash with white space in it, which the write script splits on)."""
    if isinstance(engine_hash, bytes):
        return engine_hash.hex()
    text = str(engine_hash)
    return text if not any(c.isspace() for c in text) else "x" + text.encode().hex()


def _diff(state: Any, old: dict[EngineHash, BlockKey | None], touched: list) -> BlockDiff:
    """What changed for the touched engine hashes; a key is held while any engine hash maps
    to it (the mirror's reference counts), so its membership changes only at 0 <-> 1."""
    diff, delta = BlockDiff(), {}
    for eh in dict.fromkeys(touched):
        was, now = old.get(eh), state.by_engine.get(eh)
        if was == now:
            continue
        if now is None:
            diff.unmapped.append(_h(eh))
        else:
            diff.mapped.append((_h(eh), block_id(now)))
            delta[now] = delta.get(now, 0) + 1
        if was is not None:
            delta[was] = delta.get(was, 0) - 1
    for key, d in delta.items():
        after = state.refs.get(key, 0)
        if after and after - d <= 0:
            diff.hold.append(block_id(key))
        elif not after and d < 0:
            diff.release.append(block_id(key))
    return diff


def _full_diff(state: Any) -> BlockDiff:
    """Everything the worker holds, replacing whatever Redis had of it."""
    mapped = [(_h(eh), block_id(key)) for eh, key in state.by_engine.items()]
    return BlockDiff(mapped=mapped, hold=[block_id(k) for k in state.refs], cleared=True)


def _chunks(diff: BlockDiff) -> list[BlockDiff]:
    """A full rewrite in pipelines of bounded size; only the first clears."""
    n, out = FULL_REWRITE_CHUNK, []
    for i in range(0, max(len(diff.mapped), len(diff.hold), 1), n):
        mapped, hold = diff.mapped[i : i + n], diff.hold[i : i + n]
        out.append(BlockDiff(mapped=mapped, hold=hold, cleared=diff.cleared and i == 0))
    return out
