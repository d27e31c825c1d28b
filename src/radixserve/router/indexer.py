"""`radixserve kv-indexer`: follows every worker's KV events with the router's own subscribers
and keeps the shared prefix index in Redis (schema: redis_index.py). Owns the followed-worker
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
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from radixserve.router.event_format import BlockStored, event_namespace
from radixserve.router.events import Endpoints, EventPlane, EventSubscriber
from radixserve.router.kvs_writer import RedisIndexWriter
from radixserve.router.workers import ConnectionPool, UpstreamError, _normalize

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
    """A subscriber that starts from a snapshot (batches up to its seq are in it already) and
    asks for a new one whenever the ordinary rules drop the worker (an unreplayable gap, seq
    going back, a malformed batch), instead of waiting for fresh events to rebuild it."""

    floor: int | None = None
    on_lost: Callable[[ResyncSubscriber], None] | None = None

    async def on_message(self, seq: int, payload: bytes) -> None:
        if self.floor is not None:
            if seq <= self.floor:
                return
            self.floor = None  # past the snapshot: the ordinary rules (restart, gaps) apply
        lost = self.stats.resyncs + self.stats.restarts
        await super().on_message(seq, payload)
        if self.stats.resyncs + self.stats.restarts != lost and self.on_lost is not None:
            self.on_lost(self)


class IndexerPlane(EventPlane):
    """The router's event plane, with a snapshot (or a drop) before each subscription."""

    def __init__(self, index: RedisIndexWriter, pools: dict[str, ConnectionPool]) -> None:
        super().__init__(index)
        self.writer, self.pools = index, pools
        self.resyncs = 0

    def subscribe(self, worker: Hashable, endpoints: Endpoints) -> EventSubscriber:
        old = self.subscribers.pop(worker, None)
        if old is not None:
            asyncio.get_running_loop().create_task(old.stop())
        sub = ResyncSubscriber(worker, endpoints, self.index, self.ctx)
        sub.on_lost = self._lost
        self.subscribers[worker] = sub
        asyncio.get_running_loop().create_task(self._resync(sub, start=True))
        return sub

    def _lost(self, sub: ResyncSubscriber) -> None:
        asyncio.get_running_loop().create_task(self._resync(sub, start=False))

    async def _resync(self, sub: ResyncSubscriber, start: bool) -> None:
        url = str(sub.worker)
        snap = await fetch_snapshot(self.pools[url])
        if self.subscribers.get(sub.worker) is not sub:
            return  # forgotten meanwhile
        self.resyncs += 1
        if snap is not None:
            self.writer.replace(url, snap.events)
            sub.last_seq = sub.floor = snap.seq if snap.seq >= 0 else None
            log.info("%s: resynced from a snapshot of %d blocks", url, len(snap.events))
        elif start:  # a foreign engine: nothing vouches for what Redis holds of it
            self.writer.drop_worker(url)
            log.info("%s: no snapshot; its entries are rebuilt from fresh events", url)
        if start:
            sub.start()


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
