"""KV-event subscribers: the only I/O of the event plane. One subscriber per worker reads its ZMQ
PUB stream, tracks ``seq``, recovers gaps through the worker's replay socket, and feeds a
BlockIndex; EventPlane starts and stops them as workers come and go and reports on /metrics."""

# Wire contract (vLLM's; issue 12): PUB multipart [topic, seq as 8-byte big-endian, payload];
# replay ROUTER: send [b"", start_seq as 8-byte big-endian] (the empty delimiter a REQ socket
# adds: vLLM's and SGLang's publishers ignore a request without it), get [b"", seq, payload]
# per buffered batch from start_seq on, then [b"", seq -1, b""]. Some publishers put the topic
# before seq, so only the last two frames are read.
#
# What the index may believe is what this file protects. A missed BlockRemoved would leave the
# router expecting hits a worker cannot serve, so every way of losing events ends in dropping
# the worker's entries until fresh events arrive: a gap the replay buffer no longer covers, a
# malformed batch, seq going back (the publisher restarted: its cache is empty), the PUB
# connection dropping (a dead worker: dropped at once) and coming back (rebuilt from the replay
# buffer: a restart can go unseen by seq alone), the worker removed. A
# missed BlockStored is harmless (an underestimate), so at subscription the history is replayed
# from seq 0 as far as the buffer reaches (batches published meanwhile, arriving twice, are
# skipped), and older blocks stay unknown.
#
# Runs as asyncio tasks on the router's loop (zmq.asyncio): receiving never blocks the proxy,
# and the index is only ever touched from that one thread, so it needs no lock.

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
import zmq.utils.monitor

from radixserve.router.kvindex.block_index import BlockIndex
from radixserve.router.kvindex.event_format import EventFormatError, parse_payload

log = logging.getLogger("radixserve.router.events")

WorkerId = Hashable
END_SEQ = -1
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a worker publishes: its PUB endpoint, replay endpoint (None: no replay), topic."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def endpoints_from_info(worker_url: str, info: dict[str, Any]) -> Endpoints | None:
    """The event endpoints a worker's /get_server_info reports under "kv_events" (a map or
    its JSON), with a wildcard host ("tcp://*:5557") replaced by the worker's own host; None
    when the worker publishes nothing."""
    kv = info.get("kv_events")
    if isinstance(kv, str):
        with contextlib.suppress(ValueError):
            kv = json.loads(kv)
    if not isinstance(kv, dict) or kv.get("publisher", "zmq") != "zmq":
        return None
    endpoint, replay = kv.get("endpoint"), kv.get("replay_endpoint")
    if not isinstance(endpoint, str) or not endpoint:
        return None
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    replay = _on_host(replay, host) if isinstance(replay, str) and replay else None
    return Endpoints(_on_host(endpoint, host), replay, str(kv.get("topic") or ""))


def _on_host(endpoint: str, host: str) -> str:
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint  # ipc://, inproc://: only meaningful on the same machine anyway
    bind_host, _, port = rest.rpartition(":")
    if bind_host in _WILDCARD_HOSTS:
        bind_host = f"[{host}]" if ":" in host else host
    return f"tcp://{bind_host}:{port}"


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    resyncs: int = 0
    restarts: int = 0
    reconnects: int = 0
    malformed: int = 0


class EventSubscriber:
    """One worker's event stream into `index` (see the module comment for the rules)."""

    def __init__(
        self,
        worker: WorkerId,
        endpoints: Endpoints,
        index: BlockIndex,
        ctx: zmq.asyncio.Context,
        replay_timeout_secs: float = 1.0,
    ) -> None:
        self.worker, self.endpoints, self.index, self.ctx = worker, endpoints, index, ctx
        self.replay_timeout_secs = replay_timeout_secs
        self.stats = SubscriberStats()
        self.last_seq: int | None = None
        self.lag_secs: float | None = None  # received minus published, of the last batch
        self._overlap = False
        self._sub_last: int | None = None  # the last seq the SUB socket delivered
        self._disconnected = False
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    @property
    def live(self) -> bool:
        """Past the history replay: the SUB socket has delivered a batch not seen before."""
        return self._sub_last is not None and not self._overlap

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoints.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            await self.resync()  # a worker that is idle now publishes nothing to trigger it
            self.connected.set()
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._on_connection(await monitor.recv_multipart())
                if sub in ready:
                    await self._receive(await sub.recv_multipart())
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not kill routing: forget the worker, log, stop
            log.exception("event subscriber of %s failed; its entries are dropped", self.worker)
            self.index.drop_worker(self.worker)
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _receive(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self.stats.malformed += 1
            return
        await self.on_message(_seq(frames[-2]), frames[-1])

    async def _on_connection(self, frames: list[bytes]) -> None:
        """The publisher's connection dropped and came back: maybe the same process after a
        network blip, maybe a new one on the same address (a restart, possibly before a single
        batch of it arrived). Either way its replay buffer is the truth: start over from it."""
        event = zmq.utils.monitor.parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            # dead or restarting: what it held is gone or unknowable until it is back
            self._disconnected = True
            if self.last_seq is not None:
                log.info("%s: event stream disconnected; dropping its entries", self.worker)
                self.index.drop_worker(self.worker)
        elif event == zmq.EVENT_CONNECTED and self._disconnected:
            self._disconnected = False
            self.stats.reconnects += 1
            log.info("%s: event stream reconnected; resynchronising", self.worker)
            await self.resync()

    async def resync(self) -> None:
        """Forget the worker and rebuild it from the publisher's replay buffer (all of it)."""
        if self.last_seq is not None:
            self.index.drop_worker(self.worker)
        self.last_seq = self._sub_last = None
        await self._replay(0, None)
        self._overlap = self.last_seq is not None

    async def on_message(self, seq: int, payload: bytes) -> None:
        """Apply one published batch, recovering whatever came before it first."""
        last, sub_prev, self._sub_last = self.last_seq, self._sub_last, seq
        if self._overlap:  # batches sent while the history was replayed arrive twice, in order
            if last is not None and seq <= last and (sub_prev is None or seq > sub_prev):
                return
            self._overlap = False
        if last is not None and seq <= last:
            self.stats.restarts += 1
            log.warning(
                "%s: seq went back (%d after %d): publisher restarted", self.worker, seq, last
            )
            self.index.drop_worker(self.worker)
            last = self.last_seq = None
        if last is None:
            if seq > 0:  # as much history as the replay buffer still has
                await self._replay(0, seq)
        elif seq > last + 1:
            self.stats.gaps += 1
            if not await self._replay(last + 1, seq):
                self.stats.resyncs += 1
                log.warning(
                    "%s: events %d..%d lost; dropping its entries", self.worker, last + 1, seq - 1
                )
                self.index.drop_worker(self.worker)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> bool:
        self.last_seq = seq
        try:
            batch = parse_payload(payload)
        except EventFormatError as exc:
            self.stats.malformed += 1
            self.stats.resyncs += 1
            log.warning(
                "%s: malformed event batch %d (%s); dropping its entries", self.worker, seq, exc
            )
            self.index.drop_worker(self.worker)
            return False
        self.index.apply(self.worker, batch.events)
        self.lag_secs = time.time() - batch.ts if batch.ts else None
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        return True

    async def _replay(self, start: int, until: int | None) -> bool:
        """Ask for batches start..until-1 (None: all buffered) and apply them; True if all of
        them came back."""
        if self.endpoints.replay_endpoint is None:
            return False
        self.stats.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoints.replay_endpoint)
        want = start
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout_secs)
                seq = _seq(frames[-2]) if len(frames) >= 2 else END_SEQ
                if seq == END_SEQ or (until is not None and seq >= until):
                    break
                if until is None and want == start and seq > start:
                    want = seq  # history: from the oldest batch the buffer still has
                if seq == want:  # in order; anything else is a hole the buffer cannot fill
                    self._apply(seq, frames[-1])
                    self.stats.replayed_batches += 1
                    want += 1
        except asyncio.TimeoutError:
            log.warning("%s: replay from %d timed out", self.worker, start)
        finally:
            sock.close(0)
        return want == until


def _seq(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True) if raw else END_SEQ


InfoFetcher = Callable[[], Awaitable[dict[str, Any] | None]]
"""Fetches a worker's /get_server_info: the dict, or None while the worker cannot answer."""


class EventPlane:
    """The fleet's subscribers feeding one index: `watch` a worker when it joins (its endpoints
    are discovered from /get_server_info, retried until it answers), `forget` it when it leaves."""

    def __init__(self, index: BlockIndex, discover_interval_secs: float = 2.0) -> None:
        self.index = index
        self.discover_interval_secs = discover_interval_secs
        self.ctx = zmq.asyncio.Context()
        self.subscribers: dict[WorkerId, EventSubscriber] = {}
        self._discovery: dict[WorkerId, asyncio.Task[None]] = {}

    def watch(self, worker: WorkerId, url: str, fetch_info: InfoFetcher) -> None:
        task = asyncio.get_running_loop().create_task(self._discover(worker, url, fetch_info))
        self._discovery[worker] = task

    def subscribe(self, worker: WorkerId, endpoints: Endpoints) -> EventSubscriber:
        """Start reading `endpoints` for `worker` (replacing a previous subscriber)."""
        old = self.subscribers.pop(worker, None)
        if old is not None:
            asyncio.get_running_loop().create_task(old.stop())
        sub = self.subscribers[worker] = self._subscriber(worker, endpoints)
        sub.start()
        log.info("subscribed to %s's KV events at %s", worker, endpoints.endpoint)
        return sub

    def _subscriber(self, worker: WorkerId, endpoints: Endpoints) -> EventSubscriber:
        return EventSubscriber(worker, endpoints, self.index, self.ctx)

    async def forget(self, worker: WorkerId) -> None:
        task = self._discovery.pop(worker, None)
        if task is not None:
            task.cancel()
        sub = self.subscribers.pop(worker, None)
        if sub is not None:
            await sub.stop()
        self.index.drop_worker(worker)

    async def stop(self) -> None:
        for worker in list({*self.subscribers, *self._discovery}):
            await self.forget(worker)
        self.ctx.term()

    async def _discover(self, worker: WorkerId, url: str, fetch_info: InfoFetcher) -> None:
        while True:
            info = await fetch_info()
            if info is not None:
                break
            await asyncio.sleep(self.discover_interval_secs)
        self._discovery.pop(worker, None)
        endpoints = endpoints_from_info(url, info)
        if endpoints is None:
            log.info("%s publishes no KV events: scored from the approximate tree", worker)
        else:
            self.subscribe(worker, endpoints)

    def stat_totals(self) -> dict[str, dict[WorkerId, int]]:
        """Per counter (events, gaps, replays, ...), its value per subscribed worker."""
        names = [f.name for f in fields(SubscriberStats)]
        subs = self.subscribers.items()
        return {n: {w: getattr(s.stats, n) for w, s in subs} for n in names}
