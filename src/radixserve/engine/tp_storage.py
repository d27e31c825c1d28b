"""The storage tier at ``--tp-size N``: each rank stores and loads its own KV heads' part of every
page (``kvstore.storage.PartKeys``: the key names the heads), and rank 0's StorageTier decides
for all of them. ``StoragePeers`` is rank 0's side, ``RankStorage`` a rank's (1..N-1).

Rank 0 decides, the ranks follow, in the order of the batches (all on rank 0's socket to each
rank, so a rank reads a prompt's pages before any later batch can reuse their slots, and lands
a prefetch before any batch loads it). Writes: rank 0 sends (job, keys, slots); each rank reads
its pages at once and writes the ones it lacks on a thread of its own; rank 0's writer waits for
every rank's count and keeps as stored only the pages all ranks wrote. Prefetches: rank 0 sends
(job, keys); each rank reads what it has into a buffer and reports (found, got); rank 0's
fetcher takes the minimum over the ranks and its own, so a page counts as in the store only when
every rank holds its part; rank 0 then sends the host slots it landed that many pages at (maybe
none), and each rank copies its buffer there. Replies come back on two sockets (one for each of
rank 0's I/O threads); each carries the rank's backend counts for /metrics.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

log = logging.getLogger("radixserve.engine")

STORED, FETCHED = "-stored", "-fetched"  # rank 0's reply endpoints, after the ranks' base
POLL_MS = 200
COUNTS = ("pages_written", "bytes_written", "pages_read", "bytes_read")


@dataclass(frozen=True, slots=True)
class RankStorageArgs:
    """What rank 0 opens every rank's storage tier with (its settings and namespace digest)."""

    settings: Any  # engine.storage_settings.StorageSettings
    digest: str


def backend_counts(backend: Any) -> dict[str, int]:
    """A backend's running counts that /metrics sums over the ranks."""
    st = backend.stats
    return {**{k: getattr(st, k) for k in COUNTS}, "refused": sum(st.refused.values())}


class StoragePeers:
    """Rank 0's side: send the ranks their part of each write, prefetch and landing (scheduler
    thread), and wait for their counts (the writer and fetcher threads, one socket each)."""

    def __init__(self, send: Callable[[str, Any], None], base: str, ranks: int) -> None:
        ctx = zmq.Context.instance()
        self._send, self.ranks = send, ranks
        self._socks: dict[str, zmq.Socket] = {}
        for which in (STORED, FETCHED):  # bound here; each used by one thread from now on
            self._socks[which] = sock = ctx.socket(zmq.PULL)
            sock.bind(f"ipc://{base}{which}")
        self._replies: dict[str, dict[int, list[Any]]] = {STORED: {}, FETCHED: {}}
        self.counts: dict[int, dict[str, int]] = {}  # rank -> its backend's latest counts
        self.closing = threading.Event()

    def write(self, job: int, keys: Sequence[str], slots: Sequence[int]) -> None:
        self._send("store_write", (job, list(keys), list(slots)))

    def fetch(self, job: int, keys: Sequence[str]) -> None:
        self._send("store_fetch", (job, list(keys)))

    def land(self, job: int, slots: Sequence[int]) -> None:
        """Every prefetch ends with this, landed or not (a rank drops its buffer)."""
        self._send("store_land", (job, list(slots)))

    def stored(self, job: int) -> int:
        """Writer thread: the fewest leading pages of ``job`` any rank holds (0 on close)."""
        counts = self._await(STORED, job)
        return min(counts) if counts else 0

    def fetched(self, job: int) -> tuple[int, int]:
        """Fetcher thread: the fewest pages any rank found and loaded for ``job``."""
        counts = self._await(FETCHED, job)
        if not counts:
            return 0, 0
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def _await(self, which: str, job: int) -> list[Any] | None:
        """Every rank's reply to ``job`` (ranks answer their jobs in order; a rank that died
        ends this process through the tensor-parallel watchdog, so this never waits forever)."""
        sock, got = self._socks[which], self._replies[which]
        while len(got.get(job, ())) < self.ranks:
            if self.closing.is_set():
                return None
            if sock.poll(POLL_MS):
                rank, j, count, counts = sock.recv_pyobj()
                self.counts[rank] = counts
                if j >= job:  # an earlier job's late reply: that job was given up
                    got.setdefault(j, []).append(count)
        return got.pop(job)

    def totals(self) -> dict[str, int]:
        """The ranks' backend counts, summed."""
        out = dict.fromkeys((*COUNTS, "refused"), 0)
        for counts in list(self.counts.values()):
            for k, v in counts.items():
                out[k] += v
        return out

    def close(self) -> None:
        """After rank 0's threads have stopped (they hold the sockets)."""
        self.closing.set()
        for sock in self._socks.values():
            sock.close(linger=0)


class RankStorage:
    """A rank's storage tier: its backend (keys naming its heads), its host tier, and two
    threads for the store's I/O; the rank's message loop calls ``handle``."""

    def __init__(self, args: RankStorageArgs, rank: int, host: Any, base: str) -> None:
        from radixserve.kvstore.backends import create_backend
        from radixserve.kvstore.storage import PageFormat, PartKeys, head_part

        s = args.settings
        self.rank, self.host, self.base, self.chunk = rank, host, base, s.chunk_size
        self.page_nbytes = host.bytes_per_slot * self.chunk
        inner = create_backend(s.backend, PageFormat(args.digest, self.page_nbytes), s.extra)
        self.backend = PartKeys(inner, head_part(rank, host.kv.shape[3]))
        self.buffers: dict[int, bytearray] = {}  # job -> pages fetched, until landed
        self._writes: queue.SimpleQueue[tuple[int, list[str], list[Any]]] = queue.SimpleQueue()
        self._fetches: queue.SimpleQueue[tuple[int, list[str]]] = queue.SimpleQueue()
        for target, name in ((self._run_writes, "write"), (self._run_fetches, "fetch")):
            threading.Thread(target=target, name=f"kv-storage-{name}", daemon=True).start()

    def handle(self, op: str, arg: Any) -> None:
        if op == "store_write":  # read now: a later batch may reuse the slots
            job, keys, slots = arg
            self._writes.put((job, keys, self.host.read_device_pages(slots, self.chunk)))
        elif op == "store_fetch":
            self._fetches.put(arg)
        elif op == "store_land":
            job, slots = arg
            data = self.buffers.pop(job, None)
            if data is not None and slots:
                self.host.write_host_pages(slots, data, self.chunk)

    def _reply(self, sock: zmq.Socket, job: int, count: Any) -> None:
        sock.send_pyobj((self.rank, job, count, backend_counts(self.backend)))

    def _run_writes(self) -> None:
        sock = _push(self.base + STORED)
        while True:
            job, keys, pages = self._writes.get()
            stored = 0
            try:  # written once: what is there is not written again
                stored = skip = self.backend.exists_prefix(keys)
                if skip < len(keys):
                    stored += self.backend.put_pages(keys[skip:], pages[skip:])
            except Exception as e:  # the store never takes the engine down
                log.warning("storage tier (rank %d): write failed: %r", self.rank, e)
            self._reply(sock, job, stored)

    def _run_fetches(self) -> None:
        sock = _push(self.base + FETCHED)
        while True:
            job, keys = self._fetches.get()
            found = got = 0
            try:
                found = self.backend.exists_prefix(keys)
                data = bytearray(found * self.page_nbytes)
                view, p = memoryview(data), self.page_nbytes
                got = self.backend.get_pages(keys[:found], [view[i * p : (i + 1) * p]
                                                            for i in range(found)])  # fmt: skip
                self.buffers[job] = data
            except Exception as e:  # a failing store reads as empty
                log.warning("storage tier (rank %d): prefetch failed: %r", self.rank, e)
            self._reply(sock, job, (found, got))


def _push(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(f"ipc://{endpoint}")
    return sock
