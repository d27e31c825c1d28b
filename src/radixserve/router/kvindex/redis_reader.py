"""What a router reads from the shared KV index in Redis (`route --kv-index redis://...`): one
lookup per request, gated as Llumnix gates its KV metadata service. Owns the gate and the
BlockIndex that hands kv_aware each lookup's answer."""

# The gate (Llumnix's flags): a lookup that fails is retried `--kvs-retry-times` times,
# `--kvs-retry-interval-ms` apart; when they all fail the service is marked down for
# `--kvs-metadata-service-down-duration-s`, during which requests do not wait on Redis at all:
# the index does not answer, so kv_aware scores every worker from its approximate tree, which
# it keeps from its own dispatches while Redis serves too (as cache_aware does): no cold start.
# The first request after the down duration tries Redis again. /metrics shows the state
# (kvs_up) and the counts.
#
# Why the lookup happens before `select`, outside the policy: it is I/O, and the policy is pure.
# The router awaits `prepare(request)` (an async Redis client: the event loop never blocks),
# then calls `select` in the same synchronous stretch, which reads the answer through the
# BlockIndex interface. No await falls between the two, so concurrent requests cannot mix
# their answers.

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.router.kvindex.block_index import (
    BlockIndex,
    BlockKey,
    IndexStats,
    WorkerId,
    block_keys,
)
from radixserve.router.kvindex.event_format import Event
from radixserve.router.kvindex.gate import KvsGate
from radixserve.router.kvindex.redis_store import RedisIndexStore, WorkerEntry, key_blob

log = logging.getLogger("radixserve.router")
TABLE_REFRESH_S = 1.0  # how stale a router's copy of P:workers may be


@dataclass(frozen=True, slots=True)
class KvsConfig:
    """The router's Redis settings (RouterConfig's kvs_* fields)."""

    url: str
    retry_times: int = 5
    retry_interval_ms: float = 100.0
    down_duration_s: float = 30.0
    timeout_ms: float = 500.0
    prefix: str = "radixserve"


class RedisIndexReader(BlockIndex):
    """A read-only BlockIndex over Redis for kv_aware: `prepare` looks a request up, then
    `prefix_tokens` answers from that lookup. Writes are the kv-indexer's: a router never
    writes Redis, so `apply` and `drop_worker` change nothing there."""

    def __init__(self, config: KvsConfig, resolve: Callable[[str], Hashable | None]) -> None:
        self.config, self.resolve = config, resolve
        self.gate = KvsGate(config.down_duration_s)
        self.store = RedisIndexStore(_client(config), config.prefix)
        self.stats = IndexStats()
        self.table: dict[str, WorkerEntry] = {}
        self.table_at = -math.inf
        self.answer: dict[Hashable, int] | None = {}  # None: Redis did not answer
        self.lookups = self.failures = self.fallbacks = 0
        self.lookup_seconds = 0.0

    async def prepare(self, token_ids: Sequence[int] | None, namespace: str) -> None:
        """Look the request up (with retries), or leave every worker unknown while Redis is
        down or the request has no token ids."""
        self.answer = {}
        loop = asyncio.get_running_loop()
        if not token_ids:  # not tokenized: the approximate tree decides, Redis up or not
            return
        if not self.gate.up(loop.time()):
            self.fallbacks, self.answer = self.fallbacks + 1, None
            return
        t0, error = loop.time(), None
        for attempt in range(self.config.retry_times + 1):
            try:
                self.answer = await self._lookup(token_ids, namespace)
                self.gate.mark_up()
                self.lookups += 1
                self.lookup_seconds += loop.time() - t0
                return
            except Exception as exc:  # unreachable, slow, restarted, refusing: all fall back
                self.failures, error = self.failures + 1, exc
            if attempt < self.config.retry_times and self.gate.up(loop.time()):
                await asyncio.sleep(self.config.retry_interval_ms / 1000)
        if self.gate.up(loop.time()):
            self.gate.mark_down(loop.time())
            log.warning("KV metadata service down (%r); routing from the approximate tree for "
                        "%.0f s", error, self.config.down_duration_s)  # fmt: skip
        self.fallbacks, self.answer = self.fallbacks + 1, None

    async def _lookup(self, token_ids: Sequence[int], namespace: str) -> dict[Hashable, int]:
        now = asyncio.get_running_loop().time()
        # workers and block sizes, once a second; at every lookup while none is registered
        # (a Redis restarted empty, the kv-indexer writing it again)
        if not self.table or now - self.table_at > TABLE_REFRESH_S:
            self.table, self.table_at = await self.store.workers(), now
        depths = await self._depths(token_ids, namespace)
        if any(url not in self.table or self.table[url].block_size <= 0 for url in depths):
            # a worker registered (or sized) since the table was read: read it now, or this
            # request would count a worker the index knows as holding nothing
            self.table, self.table_at = await self.store.workers(), now
            depths = await self._depths(token_ids, namespace)
        out: dict[Hashable, int] = {}
        for url, entry in self.table.items():
            wid = self.resolve(url)
            if wid is not None and entry.block_size > 0:  # registered: known, even with 0 hits
                out[wid] = depths.get(url, 0) * entry.block_size
        return out

    async def _depths(self, token_ids: Sequence[int], namespace: str) -> dict[str, int]:
        """Longest held prefix in blocks per worker URL, at every block size the table lists."""
        sizes = sorted({e.block_size for e in self.table.values() if e.block_size > 0})
        blobs = [key_blob(block_keys(token_ids, bs, namespace)) for bs in sizes]
        return await self.store.lookup(blobs)  # the client's socket timeout bounds it

    def metric_samples(self) -> list[tuple[str, str, str, float]]:
        """(name, kind, help, value) for the router's /metrics; the lookup time is a summary
        of `lookups` and `lookup_seconds`, which the collector reads itself."""
        up = int(self.gate.up(asyncio.get_running_loop().time()))
        return [
            ("kvs_up", "gauge", "1: lookups go to Redis; 0: marked down, the tree decides", up),
            ("kvs_lookups_total", "counter", "lookups answered by Redis", self.lookups),
            ("kvs_lookup_failures_total", "counter", "failed lookup attempts", self.failures),
            ("kvs_down_total", "counter", "times the service was marked down",
             self.gate.times_down),
            ("kvs_fallback_decisions_total", "counter", "decisions made without Redis",
             self.fallbacks),
        ]  # fmt: skip

    async def close(self) -> None:
        await self.store.client.aclose()

    # ----- BlockIndex -----

    def apply(self, worker: WorkerId, events: Iterable[Event]) -> None:
        """Nothing: the kv-indexer writes Redis."""

    def drop_worker(self, worker: WorkerId) -> None:
        """Nothing: the kv-indexer drops a worker it stops following."""

    def block_size(self, worker: WorkerId) -> int | None:
        entry = next((e for url, e in self.table.items() if self.resolve(url) == worker), None)
        return None if entry is None else entry.block_size

    def prefix_tokens(
        self, workers: Iterable[WorkerId], keys_for: Callable[[int], Sequence[BlockKey]]
    ) -> dict[WorkerId, int]:
        answer = self.answer or {}
        return {w: answer[w] for w in workers if w in answer}

    def answering(self) -> bool:
        return self.answer is not None

    def blocks(self) -> dict[WorkerId, int]:
        return {}


def _client(config: KvsConfig) -> Any:
    """An asyncio Redis client that fails fast: the gate does the retrying, not redis-py."""
    import redis.asyncio as aioredis  # the redis extra; only `--kv-index redis://` needs it
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    timeout = config.timeout_ms / 1000
    return aioredis.Redis.from_url(
        config.url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )
