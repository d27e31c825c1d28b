"""The storage tier's write path: a prompt's pages not known to be stored queued with their
tree path pinned, read off the device and written by the writer thread, the pins handed back."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.cache.node import path_slots
from radixserve.engine.storage_settings import StorageCounts, StorageSettings

log = logging.getLogger("radixserve.engine")


@dataclass(slots=True)
class WriteJob:
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


class StorageWrites:
    """StorageTier's writes (mixed into it; engine/storage_tier.py owns the state below and
    the known keys: ``keys``, ``_remember``, ``_forget``, ``_forget_if_restarted``)."""

    settings: StorageSettings
    chunk: int
    backend: Any
    pool: Any
    peers: Any
    counts: StorageCounts
    known: OrderedDict[str, None]
    _known_lock: threading.Lock
    _jobs: int
    _closing: bool
    _write_q: queue.SimpleQueue[WriteJob | None]
    _read: queue.Queue[WriteJob]
    _write_pages: int
    _pinned_tokens: int
    _pins_out: int

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
        self._write_q.put(WriteJob(self._jobs, new, page_slots, node, len(slots),
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

    def _hand_back(self, job: WriteJob) -> None:
        job.read, job.slots = True, []
        self._read.put(job)

    def _write(self, job: WriteJob) -> None:
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
