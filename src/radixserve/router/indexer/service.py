"""`radixserve kv-indexer`: follows every worker's KV events with the router's own subscribers
and keeps the shared prefix index in Redis (schema: kvindex/redis_store.py). Owns the followed-worker
set, the snapshot resync, the health probes that find dead workers, and the admin API."""

# Resync. An indexer (re)started with Redis intact finds entries it cannot vouch for: for each
# followed worker it asks GET /kv_events/snapshot (this project's engines) and replaces the
# worker's entries with it in one transaction, then applies events after the snapshot's seq;
# a worker without the endpoint (vLLM, SGLang) has its entries dropped and rebuilt from fresh
# events. Workers registered in Redis that the indexer does not follow are dropped at start.
# A worker that fails `failure_threshold` health probes in a row is dead: its entries leave
# Redis, and it is resynchronised like a new one when it answers again.

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from radixserve.router.kvindex.event_format import BlockStored, event_namespace
from radixserve.router.kvindex.redis_writer import RedisIndexWriter
from radixserve.router.kvindex.subscriber import Endpoints, EventPlane, EventSubscriber
from radixserve.router.proxy.workers import ConnectionPool, UpstreamError, _normalize

try:
    from orjson import loads
except ImportError:  # pragma: no cover
    from json import loads

log = logging.getLogger("radixserve.kv_indexer")


@dataclass(frozen=True, slots=True)
class Snapshot:
    seq: int
    events: list[BlockStored]


class ResyncSubscriber(EventSubscriber):
    """A subscriber whose resync (at start, on reconnect, and whenever the ordinary rules drop
    the worker: an unreplayable gap, seq going back, a malformed batch) starts from the worker's
    snapshot, then replays what the publisher sent after it; without a snapshot (a foreign
    engine) it does what the router's does: rebuild from the replay buffer."""

    def __init__(self, worker: Hashable, endpoints: Endpoints, plane: IndexerPlane) -> None:
        super().__init__(worker, endpoints, plane.writer, plane.ctx)
        self.plane, self.writer, self.resyncs = plane, plane.writer, 0

    async def resync(self) -> None:
        url = str(self.worker)
        snap = await fetch_snapshot(self.plane.pools[url])
        self.resyncs += 1
        if snap is None:
            if self.resyncs == 1:  # nothing vouches for what an earlier indexer left in Redis
                self.writer.drop_worker(url)
                log.info("%s: no snapshot; its entries are rebuilt from fresh events", url)
            await super().resync()
            return
        self.writer.replace(url, snap.events)
        self.last_seq = snap.seq if snap.seq >= 0 else None
        self._sub_last = None
        log.info("%s: resynced from a snapshot of %d blocks", url, len(snap.events))
        if self.last_seq is not None:  # what was published after the snapshot
            await self._replay(self.last_seq + 1, None)
        self._overlap = self.last_seq is not None  # the SUB socket may deliver those again

    async def on_message(self, seq: int, payload: bytes) -> None:
        lost = self.stats.resyncs + self.stats.restarts
        await super().on_message(seq, payload)
        if self.stats.resyncs + self.stats.restarts != lost:
            await self.resync()


class IndexerPlane(EventPlane):
    """The router's event plane with ResyncSubscribers, writing through the Redis writer."""

    def __init__(self, index: RedisIndexWriter, pools: dict[str, ConnectionPool]) -> None:
        super().__init__(index)
        self.writer, self.pools = index, pools

    @property
    def resyncs(self) -> int:
        return sum(getattr(s, "resyncs", 0) for s in self.subscribers.values())

    def _subscriber(self, worker: Hashable, endpoints: Endpoints) -> EventSubscriber:
        return ResyncSubscriber(worker, endpoints, self)


async def fetch_snapshot(pool: ConnectionPool, timeout: float = 30.0) -> Snapshot | None:
    """The worker's blocks as BlockStored events (parents first); None without the endpoint."""
    try:
        resp = await pool.request("GET", "/kv_events/snapshot", timeout=timeout)
        if resp.status != 200:
            return None
        snap = loads(resp.body)
        size = int(snap["block_size"])
        events = [_stored(b, size) for b in snap["blocks"]]
        return Snapshot(int(snap["seq"]), events)
    except (UpstreamError, OSError, ValueError, KeyError, TypeError):
        return None


def _stored(block: dict[str, Any], size: int) -> BlockStored:
    ns = event_namespace(block.get("lora_name"), block.get("extra_keys"))
    parent = block.get("parent_block_hash")
    return BlockStored((block["block_hash"],), parent, tuple(block["token_ids"]), size, ns)


@dataclass(slots=True)
class Followed:
    url: str
    pool: ConnectionPool
    alive: bool | None = None  # None: not probed enough yet to say
    failures: int = 0
    task: asyncio.Task[None] | None = None

    def info(self) -> dict[str, object]:
        return {"id": self.url, "url": self.url, "healthy": bool(self.alive)}


class Indexer:
    """The followed workers, their subscribers and probes, and the Redis writer."""

    def __init__(
        self, writer: RedisIndexWriter, probe_interval: float = 1.0, failure_threshold: int = 2
    ) -> None:
        self.writer = writer
        self.probe_interval, self.failure_threshold = probe_interval, failure_threshold
        self.followed: dict[str, Followed] = {}
        self.plane = IndexerPlane(writer, {})
        self._writer_task: asyncio.Task[None] | None = None

    async def start(self, urls: list[str]) -> None:
        """Follow `urls`; drop from Redis every worker registered there that is not one."""
        self._writer_task = asyncio.get_running_loop().create_task(self.writer.run())
        for url in urls:
            self.add(url)
        keep = set(self.followed)
        for url in await self.writer.store.workers():
            if url not in keep:
                self.writer.drop_worker(url)
                log.info("%s is registered in Redis but not followed: dropped", url)

    def add(self, url: str) -> Followed:
        """Follow `url` (ValueError if malformed or already followed)."""
        url = _normalize(url)
        if url in self.followed:
            raise ValueError(f"worker {url} is already followed")
        pool = ConnectionPool(url)
        worker = self.followed[url] = Followed(url, pool)
        self.plane.pools[url] = pool
        worker.task = asyncio.get_running_loop().create_task(self._probe_loop(worker))
        return worker

    async def remove(self, url: str) -> Followed | None:
        worker = self.followed.pop(_normalize(url), None)
        if worker is not None:
            if worker.task is not None:
                worker.task.cancel()
            await self.plane.forget(worker.url)  # its entries leave Redis
            worker.pool.close()
        return worker

    async def stop(self) -> None:
        for url in list(self.followed):
            worker = self.followed.pop(url)
            if worker.task is not None:
                worker.task.cancel()
            worker.pool.close()
        await self.writer.flushed(timeout=2.0)  # entries stay: a restarted indexer resyncs
        if self._writer_task is not None:
            self._writer_task.cancel()
        for sub in list(self.plane.subscribers.values()):
            await sub.stop()
        self.plane.ctx.term()

    async def _probe_loop(self, worker: Followed) -> None:
        while True:
            ok = await _healthy(worker.pool, self.probe_interval)
            worker.failures = 0 if ok else worker.failures + 1
            if ok and not worker.alive:
                worker.alive = True
                self.plane.watch(worker.url, worker.url, lambda p=worker.pool: _info(p))
            elif worker.alive is not False and worker.failures >= self.failure_threshold:
                worker.alive = False  # also dead at start: what Redis still holds of it goes
                log.warning("%s failed its health checks: its entries leave Redis", worker.url)
                await self.plane.forget(worker.url)
            await asyncio.sleep(self.probe_interval)


async def _healthy(pool: ConnectionPool, timeout: float) -> bool:
    try:
        return (await pool.request("GET", "/health", timeout=max(timeout, 0.5))).status == 200
    except (UpstreamError, OSError):
        return False


async def _info(pool: ConnectionPool) -> dict[str, Any] | None:
    try:
        resp = await pool.request("GET", "/get_server_info", timeout=5.0)
        return loads(resp.body) if resp.status == 200 else None
    except (UpstreamError, OSError, ValueError):
        return None
