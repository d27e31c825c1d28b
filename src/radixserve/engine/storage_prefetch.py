"""The storage tier's prefetch path: a new request's chunks beyond what the tree holds looked
up and read by the prefetch thread, landed in the host tier between steps, the request handed
back by its prefetch policy; and how much of a request's hit the store gave."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.engine.storage_settings import StorageCounts, StorageSettings, prefetch_timeout_s

log = logging.getLogger("radixserve.engine")


@dataclass(slots=True)
class FetchJob:
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


class StoragePrefetch:
    """StorageTier's prefetches (mixed into it; engine/storage_tier.py owns the state below and
    the known keys: ``keys``, ``_remember``)."""

    settings: StorageSettings
    chunk: int
    backend: Any
    pool: Any
    peers: Any
    clock: Callable[[], float]
    meter: Any
    page_nbytes: int
    counts: StorageCounts
    fetches: dict[str, FetchJob]
    loaded: dict[str, int]
    _jobs: int
    _claimed: int
    _done: queue.SimpleQueue[FetchJob]
    _fetch_q: queue.SimpleQueue[FetchJob | None]

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
        f = FetchJob(req.rid, self._jobs, ids[: len(keys) * self.chunk], ns, first, keys[first:],
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

    def _land(self, f: FetchJob, cache: Any) -> Sequence[int]:
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
