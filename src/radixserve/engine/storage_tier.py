"""The storage tier inside the engine (`serve --hicache-storage-backend mooncake | file`): prompt
pages written once to a KV store, and a request's next pages prefetched from it into the host
tier while the request waits, so that the host tier's load brings them to the device.

Who does what. The scheduler thread (``Worker``) owns the tree, the host tier and the pools:
after a forward that completed a prompt it computes the prompt's chunk keys, pins the tree path
that holds the chunks not known to be stored (``KVManager.pin``: not evicted, so their device
slots are not reused) and queues (keys, slots, pin) for the writer thread, which asks the store
which of them it has already, reads only the missing pages from the device pool (one gather,
off the scheduler thread; on a GPU on a stream of its own) and writes them, handing the pin
back first; the scheduler thread unpins between steps (``release_pins``), so the tree is only
ever touched by it. A pinned path is like a running request's prefix: not room for others until
it is released; the pins out are bounded (half the device pool or one prompt, whichever is
more, and ``write_queue_pages``), so a hung store keeps at most that much from eviction. On a
new request it asks the tree how much of the prompt either tier holds, and hands the chunk keys
after that to the prefetch thread, as many as the host tier can make room for besides the
prefetches in flight (``cache.host_room``: free slots, host copies of pages the device holds
too, host-only leaves; the rest are skipped, counted: never read to be dropped); between steps
it takes finished prefetches (``poll``): host slots are made (``cache.land_slots``), the bytes
copied in, the pages inserted as host-only nodes (``cache.insert_host``), and a request that
waited is queued. Only the two threads talk to the store, so a slow or dead store never holds
the scheduler up; a request waiting on its prefetch is not in the scheduler yet, so the others
are admitted meanwhile.

Prefetch policies (SGLang's): ``best_effort`` queues the request at once (what has landed when
it is admitted is used; later pages still land for the next request), ``wait_complete`` holds it
until the prefetch ends, ``timeout`` holds it at most 2 s + 0.1 s per 1,024 tokens looked up,
capped at 30 s. Writes are bounded (``write_queue_pages``, and the pinned tokens): a full queue
drops the pages, counted, pinning nothing (the store is a cache). Every loaded page has passed
the backend's header check (namespace, key, size, checksum): a refused or missing page ends the
prefetch there; the rest is recomputed.

At ``--tp-size N`` this is rank 0's, deciding for every rank (``peers``: engine/tp_storage.py):
each rank's keys name its KV heads (``part``), a write is stored once every rank wrote its part,
and a prefetch lands as many pages as the rank with the fewest loaded.

This module holds what both paths share (the store, the keys known to be stored, the threads'
lifetime); the write path is engine/storage_writes.py, the prefetch path
engine/storage_prefetch.py, the flags and counts engine/storage_settings.py.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from radixserve.cache.hashing import KVNamespace, page_keys
from radixserve.engine.storage_prefetch import FetchJob, StoragePrefetch
from radixserve.engine.storage_settings import StorageCounts, StorageSettings
from radixserve.engine.storage_writes import StorageWrites, WriteJob

KNOWN_KEYS_MAX = 1 << 17  # keys remembered as stored (never offered again while remembered)
PRIVATE_PREFIX = "prompt-logprobs:"  # a request's own namespace: nobody else could reuse it


class StorageTier(StorageWrites, StoragePrefetch):
    """The scheduler thread's side of the storage tier, and its two I/O threads."""

    def __init__(
        self,
        settings: StorageSettings,
        namespace: KVNamespace,
        pool: Any,  # model.host_pool.HostKVPool
        clock: Callable[[], float] = time.monotonic,
        meter: Any = None,  # engine.load_meter.LoadRatioMeter: fed each prefetch's read time
        parts: Sequence[str] = (),  # --tp-size N: the heads each rank's part of a page holds
        peers: Any = None,  # --tp-size N: engine.tp_storage.StoragePeers (ranks 1..N-1)
    ) -> None:
        from radixserve.kvstore.backends import create_backend
        from radixserve.kvstore.storage import PageFormat, PartKeys

        self.settings = s = settings
        self.chunk = s.chunk_size
        self.namespace = namespace
        self.digest = namespace.digest()
        self.pool = pool
        self.clock = clock
        self.meter = meter
        self.page_nbytes = pool.bytes_per_slot * self.chunk
        self.backend = create_backend(s.backend, PageFormat(self.digest, self.page_nbytes), s.extra)
        if parts:  # this is rank 0: its part first
            self.backend = PartKeys(self.backend, parts[0])
        self.parts, self.peers = list(parts), peers
        self._jobs = 0  # numbers the writes and prefetches for the ranks
        self.counts = StorageCounts()
        self.known: OrderedDict[str, None] = OrderedDict()  # stored, or queued to be
        self._known_lock = threading.Lock()
        self._outages = 0
        self.fetches: dict[str, FetchJob] = {}  # by rid, until landed
        self.loaded: dict[str, int] = {}  # rid -> tokens its prefetch landed (for its report)
        self._claimed = 0  # pages the prefetches in flight will want host room for
        self._done: queue.SimpleQueue[FetchJob] = queue.SimpleQueue()
        self._fetch_q: queue.SimpleQueue[FetchJob | None] = queue.SimpleQueue()
        self._write_q: queue.SimpleQueue[WriteJob | None] = queue.SimpleQueue()
        self._read: queue.Queue[WriteJob] = queue.Queue()  # jobs whose pages were read: unpin
        self._write_pages = 0  # pages queued for the writer, not yet written
        self._pinned_tokens = 0  # scheduler thread only: tokens the queued jobs' pins keep
        self._pins_out = 0  # jobs whose pin the scheduler thread has not released
        self._closing = False
        self._threads = [
            threading.Thread(target=self._run_fetches, name="kv-storage-fetch", daemon=True),
            threading.Thread(target=self._run_writes, name="kv-storage-write", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def info(self) -> dict[str, Any]:
        """For /get_server_info: how a router computes this engine's keys (issue 28's reader);
        engines mount no segment of their own (pages live in the store process's)."""
        s = self.settings
        return {"backend": s.backend, "namespace": self.digest, "segment": None,
                "chunk_size": self.chunk, "hash_algo": s.hash_algo, "seed": s.seed,
                "placeholder": False, "prefetch_policy": s.prefetch_policy,
                **({"key_parts": self.parts} if self.parts else {})}  # fmt: skip

    # -- keys ----------------------------------------------------------------------------------
    def keys(self, ids: Sequence[int], namespace: Hashable | None) -> list[str] | None:
        """The chunk keys of ``ids`` (None for a request's private namespace)."""
        if isinstance(namespace, str) and namespace.startswith(PRIVATE_PREFIX):
            return None
        ns = None if namespace is None else str(namespace)
        s = self.settings
        return page_keys(ids, self.namespace, None, s.hash_algo, s.seed, ns)

    def _forget_if_restarted(self) -> None:
        """A store that was down may have lost every key (a Mooncake master restarts empty)."""
        outages = getattr(getattr(self.backend, "gate", None), "outages", 0)
        if outages != self._outages:
            self._outages = outages
            with self._known_lock:
                self.known.clear()

    def _remember(self, keys: Sequence[str]) -> None:
        with self._known_lock:
            for k in keys:
                self.known[k] = None
                self.known.move_to_end(k)
            while len(self.known) > KNOWN_KEYS_MAX:
                self.known.popitem(last=False)

    def _forget(self, keys: Sequence[str]) -> None:
        with self._known_lock:
            for k in keys:
                self.known.pop(k, None)

    def stats(self) -> dict[str, int]:
        """The counts; at --tp-size N the store's (pages, bytes, refusals) are every rank's
        parts summed: a page written is N values written."""
        from radixserve.engine.tp_storage import backend_counts

        n = backend_counts(self.backend)
        if self.peers is not None:
            n = {k: v + self.peers.totals()[k] for k, v in n.items()}
        c = self.counts
        c.storage_pages_written, c.storage_bytes_written = n["pages_written"], n["bytes_written"]
        c.storage_pages_read, c.storage_bytes_read = n["pages_read"], n["bytes_read"]
        c.storage_refused_pages = n["refused"]
        c.storage_write_pinned_tokens = self._pinned_tokens
        out = {k: getattr(c, k) for k in c.__dataclass_fields__ if k != "extra"}
        out["storage_up"] = int(self.backend.available)
        return out

    def close(self, kv: Any = None) -> None:
        """Stop both threads (jobs still queued are dropped, not written) and release every
        pin their pages held (``kv``: the scheduler's KVManager, when the tree lives on)."""
        self._closing = True
        if self.peers is not None:  # a thread waiting on the ranks stops waiting
            self.peers.closing.set()
        self._fetch_q.put(None)
        self._write_q.put(None)
        for t in self._threads:
            t.join(5)
        if self.peers is not None:
            self.peers.close()
        if kv is not None:
            self.release_pins(kv)
        self.backend.close()
