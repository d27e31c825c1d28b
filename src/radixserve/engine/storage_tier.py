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
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.hashing import ALGORITHMS, KVNamespace, page_keys
from radixserve.cache.node import path_slots

log = logging.getLogger("radixserve.engine")

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
OWN_KEYS = {"chunk_size": 256, "hash_algo": "sha256_cbor", "seed": 0, "write_queue_pages": 4096}
KNOWN_KEYS_MAX = 1 << 17  # keys remembered as stored (never offered again while remembered)
PRIVATE_PREFIX = "prompt-logprobs:"  # a request's own namespace: nobody else could reuse it


def weights_identity(model_dir: Any, head_bytes: int = 1 << 20) -> str:
    """A digest of a model directory's config and weight files (their names, sizes and first
    MiB): part of the storage namespace, so models that share a name never share pages."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    root = Path(model_dir)
    for path in sorted(root.iterdir()):
        if path.name == "config.json" or path.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            h.update(f"{path.name}:{path.stat().st_size}:".encode())
            with open(path, "rb") as f:
                h.update(f.read(head_bytes))
    return h.hexdigest()[:16]


def prefetch_timeout_s(tokens: int) -> float:
    """SGLang's timeout policy: 2 s + 0.1 s per 1,024 tokens, at most 30 s."""
    return min(2.0 + 0.1 * tokens / 1024, 30.0)


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """The flags checked: the backend, its extra config (without our own keys), the policy."""

    backend: str
    extra: dict[str, Any]
    prefetch_policy: str = "best_effort"
    chunk_size: int = 256
    hash_algo: str = "sha256_cbor"
    seed: int = 0
    write_queue_pages: int = 4096

    @classmethod
    def parse(cls, backend: str, extra_config: str | None, policy: str | None) -> StorageSettings:
        """From `--hicache-storage-backend`, `--hicache-storage-backend-extra-config` (JSON:
        the backend's keys plus ours: chunk_size, hash_algo, seed, write_queue_pages) and
        `--hicache-storage-prefetch-policy`; ValueError names what is wrong."""
        if backend not in ("mooncake", "file"):
            raise ValueError(f"--hicache-storage-backend must be mooncake or file, not {backend!r}")
        try:
            extra = json.loads(extra_config) if extra_config else {}
        except ValueError as e:
            raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
        own = {k: extra.pop(k, v) for k, v in OWN_KEYS.items()}
        for key in ("chunk_size", "write_queue_pages"):
            if type(own[key]) is not int or own[key] < 1:
                raise ValueError(f"--hicache-storage-backend-extra-config {key} must be an "
                                 f"integer >= 1, got {own[key]!r}")  # fmt: skip
        if own["hash_algo"] not in ALGORITHMS:
            raise ValueError(f"--hicache-storage-backend-extra-config hash_algo "
                             f"{own['hash_algo']!r}: choose from {sorted(ALGORITHMS)}")  # fmt: skip
        if type(own["seed"]) is not int:
            raise ValueError(f"--hicache-storage-backend-extra-config seed must be an integer, "
                             f"got {own['seed']!r}")  # fmt: skip
        policy = policy or "best_effort"
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"--hicache-storage-prefetch-policy must be one of "
                             f"{', '.join(PREFETCH_POLICIES)}, not {policy!r}")  # fmt: skip
        return cls(backend, extra, policy, **own)


@dataclass(slots=True)
class _Fetch:
    """One request's prefetch: chunk keys from chunk ``first`` on."""

    rid: str
    job: int  # its number, as the tensor-parallel ranks know it
    ids: Sequence[int]
    namespace: Hashable | None
    first: int
    keys: list[str]
    deadline: float | None  # timeout policy only
    req: Any = None  # the request while it waits here (None: already queued)
    found: int = 0  # pages the store listed
    got: int = 0  # pages loaded and accepted
    data: bytearray | None = None
    done: bool = False
    seconds: float = 0.0  # the store's lookup and reads (the load-to-prefill ratio's sample)


@dataclass(slots=True)
class _Write:
    """One prompt's pages for the writer: their keys and device slots (a page each), the tree
    node pinned for them (released by the scheduler thread once ``read``), and the tokens
    that pin keeps."""

    job: int  # its number, as the tensor-parallel ranks know it
    keys: list[str]
    slots: list[Any]
    node: Any
    tokens: int
    ready: Any  # the pool's device_ready() after the forward that wrote them
    read: bool = False


@dataclass(slots=True)
class StorageCounts:
    """What /metrics shows of the storage tier (monotonic counts, and whether it is up)."""

    storage_up: int = 1
    storage_prefetch_lookups: int = 0
    storage_prefetch_waits: int = 0  # requests held while their prefetch ran
    storage_prefetch_timeouts: int = 0  # held requests queued at their deadline
    storage_prefetch_failures: int = 0  # prefetches that loaded fewer pages than listed
    storage_prefetch_tokens: int = 0  # tokens landed in the host tier from the store
    storage_prefetch_skipped_pages: int = 0  # not read: beyond the host room for a prefetch
    storage_prefetch_unlanded_pages: int = 0  # read, but the host room was gone when they came
    storage_write_dropped_pages: int = 0  # not written: the writer's queue was full
    storage_pages_written: int = 0
    storage_pages_gathered: int = 0  # pages read from the device pool for the writer
    storage_write_pinned_tokens: int = 0  # device tokens pinned for the writer now
    storage_bytes_written: int = 0
    storage_pages_read: int = 0
    storage_bytes_read: int = 0
    storage_refused_pages: int = 0  # values of another namespace, size, key or checksum
    storage_cached_tokens: int = 0  # prompt tokens served from pages the store gave
    extra: dict[str, int] = field(default_factory=dict)


class StorageTier:
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
        self.fetches: dict[str, _Fetch] = {}  # by rid, until landed
        self.loaded: dict[str, int] = {}  # rid -> tokens its prefetch landed (for its report)
        self._claimed = 0  # pages the prefetches in flight will want host room for
        self._done: queue.SimpleQueue[_Fetch] = queue.SimpleQueue()
        self._fetch_q: queue.SimpleQueue[_Fetch | None] = queue.SimpleQueue()
        self._write_q: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._read: queue.Queue[_Write] = queue.Queue()  # jobs whose pages were read: unpin
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

    # -- writes ----------------------------------------------------------------------------------
    def offer_write(self, ids: Sequence[int], namespace: Hashable | None, kv: Any) -> None:
        """A prompt a forward just completed, now in the tree (``kv``: the scheduler's
        ``sched.kv.KVManager``; called after ``on_output``): its whole chunks not known to be
        stored are queued for the writer thread, with their slots pinned (never read here:
        the writer reads the ones the store lacks). Never waits."""
        n = len(ids) - len(ids) % self.chunk
        if n < self.chunk:
            return
        keys = self.keys(ids[:n], namespace)
        if not keys:
            return
        self._forget_if_restarted()
        with self._known_lock:
            todo = [i for i, k in enumerate(keys) if k not in self.known]
        if not todo:
            return
        chunk = self.chunk
        node, length = kv.cache.device_prefix(ids[: (todo[-1] + 1) * chunk], namespace)
        todo = [i for i in todo if (i + 1) * chunk <= length]  # the pages the device holds
        if not todo:
            return
        slots = path_slots(node)  # the pin keeps the whole path: the node may go on past them
        limit = min(self.settings.write_queue_pages * chunk, kv.total // 2)
        if self._write_pages + len(todo) > self.settings.write_queue_pages or (
            self._pins_out and self._pinned_tokens + len(slots) > limit  # one always may
        ):
            self.counts.storage_write_dropped_pages += len(todo)
            return
        page_slots = [slots[i * chunk : (i + 1) * chunk] for i in todo]
        kv.pin(node)
        self._pinned_tokens += len(slots)
        self._pins_out += 1
        new = [keys[i] for i in todo]
        self._remember(new)  # queued: not offered again meanwhile (forgotten if it fails)
        with self._known_lock:
            self._write_pages += len(new)
        self._jobs += 1
        if self.peers is not None:  # each rank reads its part of them before the next batch
            self.peers.write(self._jobs, new, [s for page in page_slots for s in page])
        self._write_q.put(_Write(self._jobs, new, page_slots, node, len(slots),
                                 self.pool.device_ready()))  # fmt: skip

    def release_pins(self, kv: Any, wait_s: float = 0.0) -> int:
        """Scheduler thread, between steps: unpin the jobs whose pages the writer has read
        (waiting up to ``wait_s`` for all of them: a flush). Returns the pins still out."""
        deadline = time.monotonic() + wait_s
        while self._pins_out:
            try:
                timeout = max(0.0, deadline - time.monotonic())
                job = self._read.get(timeout=timeout) if timeout else self._read.get_nowait()
            except queue.Empty:
                break
            kv.unpin(job.node)
            self._pinned_tokens -= job.tokens
            self._pins_out -= 1
        return self._pins_out

    def pinning(self) -> bool:
        """Pins out (the scheduler loop then polls now and then to release them)."""
        return bool(self._pins_out)

    def _run_writes(self) -> None:
        while (job := self._write_q.get()) is not None:
            try:
                self._write(job)
            except Exception as e:  # the store never takes the engine down
                self._forget(job.keys)
                log.warning("storage tier: write failed: %r", e)
            finally:
                if not job.read:
                    self._hand_back(job)
                with self._known_lock:
                    self._write_pages -= len(job.keys)

    def _hand_back(self, job: _Write) -> None:
        job.read, job.slots = True, []
        self._read.put(job)

    def _write(self, job: _Write) -> None:
        if self._closing:
            self._forget(job.keys)
            return
        keys = job.keys
        skip = self.backend.exists_prefix(keys)  # written once: what is there is not read
        pages: list[Any] = []
        if skip < len(keys):
            slots = [s for page in job.slots[skip:] for s in page]
            pages = self.pool.read_device_pages(slots, self.chunk, job.ready)
            self.counts.storage_pages_gathered += len(pages)
        self._hand_back(job)  # read: the scheduler may unpin them
        stored = skip
        if pages:
            stored += self.backend.put_pages(keys[skip:], pages)
        if self.peers is not None:  # stored: every rank's part is
            stored = min(stored, self.peers.stored(job.job))
        if stored < len(keys):
            self._forget(keys[stored:])

    # -- prefetch --------------------------------------------------------------------------------
    def lookup(self, req: Any, cache: Any) -> bool:
        """Start the prefetch of ``req``'s chunks beyond what either tier holds. True when the
        request is to wait here (``poll`` hands it back); False: queue it now."""
        ids, ns = req.input_ids, req.namespace
        if len(ids) < self.chunk + 1 or req.rid in self.fetches or not self._may_try():
            return False
        # the last token is always computed: only chunks before it can be loaded
        n = (len(ids) - 1) // self.chunk * self.chunk
        first = cache.cached_len(ids[:n], ns) // self.chunk
        keys = self.keys(ids[:n], ns)
        if not keys or first >= len(keys):
            return False
        fit = self._host_room(cache, len(keys) - first)
        self.counts.storage_prefetch_skipped_pages += len(keys) - first - fit
        if not fit:
            return False
        keys = keys[: first + fit]
        policy = self.settings.prefetch_policy
        wait = policy != "best_effort"
        deadline = None
        if policy == "timeout":
            deadline = self.clock() + prefetch_timeout_s(fit * self.chunk)
        self._jobs += 1
        f = _Fetch(req.rid, self._jobs, ids[: len(keys) * self.chunk], ns, first, keys[first:],
                   deadline, req if wait else None)  # fmt: skip
        if self.peers is not None:
            self.peers.fetch(f.job, f.keys)
        self.fetches[req.rid] = f
        self._claimed += fit
        self.counts.storage_prefetch_lookups += 1
        if wait:
            self.counts.storage_prefetch_waits += 1
        self._fetch_q.put(f)
        return wait

    def _host_room(self, cache: Any, pages: int) -> int:
        """How many of ``pages`` can land in the host tier, after the prefetches in flight
        (only those are read: a page with nowhere to land is not worth its read)."""
        c = self.chunk
        room = cache.host_room((self._claimed + pages) * c) // c
        return max(0, room - self._claimed)

    def _may_try(self) -> bool:
        """False while the backend is marked down and its down duration runs: a lookup would
        be refused at once, so the request is not held for it (the first one after the
        duration goes through, and reconnects)."""
        gate = getattr(self.backend, "gate", None)
        return gate is None or gate.up or gate.clock() >= gate.down_until

    def waiting(self) -> bool:
        """Prefetches in flight (the scheduler loop then polls often instead of sleeping)."""
        return bool(self.fetches)

    def cancel(self, rid: str) -> None:
        """An aborted request: it is not handed back (its pages still land when fetched)."""
        f = self.fetches.get(rid)
        if f is not None:
            f.req = None
        self.loaded.pop(rid, None)

    def _run_fetches(self) -> None:
        while (f := self._fetch_q.get()) is not None:
            t0 = time.perf_counter()
            try:
                f.found = self.backend.exists_prefix(f.keys)
                if f.found:
                    f.data = bytearray(f.found * self.page_nbytes)
                    view, p = memoryview(f.data), self.page_nbytes
                    bufs = [view[i * p : (i + 1) * p] for i in range(f.found)]
                    f.got = self.backend.get_pages(f.keys[: f.found], bufs)
            except Exception as e:  # a failing store reads as empty
                log.warning("storage tier: prefetch failed: %r", e)
                f.got = 0
            if self.peers is not None:  # a page is in the store when every rank's part is
                found, got = self.peers.fetched(f.job)
                f.found, f.got = min(f.found, found), min(f.got, got)
            f.seconds = time.perf_counter() - t0
            f.done = True
            self._done.put(f)

    def poll(self, cache: Any) -> list[Any]:
        """Between steps: land finished prefetches in the host tier; returns the requests to
        queue now (their prefetch ended, or its deadline passed)."""
        ready = []
        while True:
            try:
                f = self._done.get_nowait()
            except queue.Empty:
                break
            self.fetches.pop(f.rid, None)
            self._claimed -= len(f.keys)
            if f.got < f.found:
                self.counts.storage_prefetch_failures += 1
            slots: Sequence[int] = ()
            if f.got:
                if self.meter is not None:
                    self.meter.store_loaded(f.seconds, f.got * self.chunk)
                slots = self._land(f, cache)
            if self.peers is not None:  # the ranks land theirs at the same host slots
                self.peers.land(f.job, slots)
            if f.req is not None:
                ready.append(f.req)
        if self.settings.prefetch_policy == "timeout":
            now = self.clock()
            for f in self.fetches.values():
                if f.req is not None and f.deadline is not None and now >= f.deadline:
                    self.counts.storage_prefetch_timeouts += 1
                    ready.append(f.req)
                    f.req = None  # its pages still land when they come
        self.counts.storage_up = int(self.backend.available)
        return ready

    def _land(self, f: _Fetch, cache: Any) -> Sequence[int]:
        """Put ``f.got`` fetched pages in the host tier as host-only nodes of the tree: as
        many leading ones as the host tier has room for now (room sized at lookup may have
        gone to the device's copies meanwhile; the rest are counted, not landed)."""
        self._remember(f.keys[: f.found])
        c = self.chunk
        start, end = f.first * c, (f.first + f.got) * c
        slots = cache.land_slots(f.ids, start, end, c, f.namespace)
        self.counts.storage_prefetch_unlanded_pages += f.got - len(slots) // c
        if not len(slots):
            return slots
        self.pool.write_host_pages(slots, f.data, c)
        # nothing is inserted if the part before them left both tiers meanwhile
        added = cache.insert_host(f.ids[: start + len(slots)], slots, f.namespace, start)
        self.counts.storage_prefetch_tokens += added
        self.loaded[f.rid] = self.loaded.get(f.rid, 0) + added
        return slots

    # -- reports ---------------------------------------------------------------------------------
    def split_cached(self, rid: str, host_tokens: int, finished: bool) -> tuple[int, int]:
        """A request's host-tier tokens as (host, storage): the ones its prefetch landed count
        as the store's."""
        landed = self.loaded.pop(rid, 0) if finished else self.loaded.get(rid, 0)
        storage = min(landed, host_tokens)
        if finished:
            self.counts.storage_cached_tokens += storage
        return host_tokens - storage, storage

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
