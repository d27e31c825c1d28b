"""KV slot allocation: a page-granular free list of token slots, and the per-request slot table.

Slot ids index the model's KV tensors; pages are ``page_size`` consecutive slots. Pure Python.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import floordiv

from radixserve.cache.tokens import SLOT_CODE, slot_iota

_W = array(SLOT_CODE).itemsize  # bytes per slot id
MARK_PIECE = 32  # pages below which _mark sets flags one by one rather than look for runs
IOTA_MIN_GROWTH = 4096  # slot ids added to the iota at least at a time


class SlotError(RuntimeError):
    """A slot was freed twice, freed without being allocated, or the pool is exhausted."""


class SlotAllocator:
    """Hands out token slots in whole pages; ``page_size == 1`` makes it token-granular.

    Slots come and go as ``array('q')``: a free of thousands of slots (an eviction, a finished
    request) checks and clears them with C-speed slice operations when they are one run of
    pages, which is the common case, and with one sort of the page ids otherwise."""

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1 or num_slots < page_size:
            raise ValueError(f"need num_slots >= page_size >= 1, got {num_slots}, {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.reset()

    @property
    def total(self) -> int:
        return self.num_pages * self.page_size

    def reset(self) -> None:
        # freed pages are reused last-freed first; then never-used pages, low ids first. The
        # never-used ones are a counter, not a list: a pool of 400k pages starts in no time
        # the freed pages: a stack in a buffer of the pool's size, filled to _nfree, so a free
        # is one slice copy, never a regrowth of the whole list (a page is freed at most once)
        self._free_buf = array(SLOT_CODE, [0]) * self.num_pages
        self._nfree = 0
        self._fresh = 0  # pages [_fresh, num_pages) were never handed out
        self._in_use = bytearray(self.num_pages)
        # iota: the ids 0, 1, 2, ... of every slot handed out so far, as the raw bytes of an
        # array(SLOT_CODE): runs of slot and page ids are sliced from it (a memcpy) instead of
        # built from a range (an int object per id), and a freed run is checked against it
        # with bytearray.startswith (a memcmp, no copy of either side)
        self._iota = bytearray()
        # at page size > 1, the bytes of each page's slots (page i: its p ids), cut from the
        # iota once when scattered pages are first gathered (freed leaves come back scattered)
        self._page_bytes: list[bytes] = []

    def available(self) -> int:
        """Free token slots (whole pages)."""
        return (self._nfree + self.num_pages - self._fresh) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_tokens: int) -> array:
        """Slots for ``num_tokens`` tokens, in ``ceil(num_tokens / page_size)`` fresh pages.
        The unused tail of the last page stays reserved for the same owner (see ``extend``)."""
        if num_tokens < 0:
            raise ValueError(f"cannot allocate {num_tokens} slots")
        p = self.page_size
        pages = -(-num_tokens // p)
        if pages > self._nfree + self.num_pages - self._fresh:
            raise SlotError(f"out of KV slots: need {num_tokens}, have {self.available()}")
        if pages == 1:  # a decode step: one page per request
            if self._nfree:
                self._nfree -= 1
                page = self._free_buf[self._nfree]
            else:
                page = self._fresh
                self._fresh += 1
            self._in_use[page] = 1
            return array(SLOT_CODE, (page,) if p == 1 else range(page * p, page * p + num_tokens))
        if not pages:
            return array(SLOT_CODE)
        if not self._nfree:  # only never-used pages: one ascending run (a fresh host tier)
            lo = self._fresh
            self._fresh = lo + pages
            self._iota_to(self._fresh * p)
            self._in_use[lo : lo + pages] = b"\x01" * pages
            return self._ids(lo * p, lo * p + num_tokens)
        taken = self._take(pages)
        self._mark(taken, 1)
        if p == 1:
            return taken
        return self._slots_of(taken, num_tokens)

    def alloc_many(self, counts: Sequence[int]) -> list[array]:
        """``[alloc(n) for n in counts]``: the same slots, in the same order, with one flag pass
        and one gather for all (a decode run's pages, one allocation per request)."""
        p = self.page_size
        each = [-(-n // p) for n in counts]
        if len(counts) < 2 or min(counts) < 0 or sum(each) > self.available() // p:
            return [self.alloc(n) for n in counts]  # errors as the allocation at fault has them
        buf, top, fresh = self._free_buf, self._nfree, self._fresh
        taken = []
        for k in each:  # each alloc takes the top of the freed stack, then never-used pages
            reused = k if k <= top else top
            part = buf[top - reused : top]
            top -= reused
            if k > reused:
                part += self._ids_of_pages(fresh, fresh + k - reused)
                fresh += k - reused
            taken.append(part)
        self._nfree, self._fresh = top, fresh
        pages = array(SLOT_CODE)
        for part in taken:
            pages += part
        self._mark(pages, 1)
        if p == 1:
            return taken
        raw, size, out, off = self._page_bytes_of(pages), p * _W, [], 0
        for n, k in zip(counts, each):
            slots = array(SLOT_CODE)
            slots.frombytes(raw[off : off + n * _W])
            out.append(slots)
            off += k * size
        return out

    def _ids_of_pages(self, lo: int, hi: int) -> array:
        self._iota_to(hi * self.page_size)
        return self._ids(lo, hi)

    def _take(self, pages: int) -> array:
        """The next ``pages`` free pages in handing-out order (there are enough)."""
        n = self._nfree
        reused = min(pages, n)
        taken = self._free_buf[n - reused : n]  # the last freed, in the order they were freed:
        self._nfree = n - reused  # a run freed whole comes back as an ascending run
        if pages > reused:
            fresh = self._fresh
            self._fresh = fresh + pages - reused
            self._iota_to(self._fresh * self.page_size)
            taken += self._ids(fresh, self._fresh)
        return taken

    def _iota_to(self, n: int) -> None:
        have = len(self._iota) // _W
        if have < n:  # doubled at least: a pool filled a few pages at a time (the host tier)
            # builds its ids in a few calls, not one per allocation (by an eighth, the small
            # pieces and the copies of the bytes so far cost 4x building them at once)
            n = min(max(n, 2 * have + IOTA_MIN_GROWTH), self.num_pages * self.page_size)
            self._iota += slot_iota(have, n)

    def _gather(self, pages: array, n: int) -> array:
        """The first ``n`` slots of scattered ``pages``, as an array."""
        out = array(SLOT_CODE)
        out.frombytes(self._page_bytes_of(pages))
        del out[n:]
        return out

    def _page_bytes_of(self, pages: Sequence[int]) -> bytes:
        """The slots of ``pages`` (handed out before), as raw bytes: each page's bytes are cut
        from the ids once (for the pages handed out so far), then joined in one C-level pass."""
        pb, size = self._page_bytes, self.page_size * _W
        if len(pb) < self._fresh:
            self._iota_to(self._fresh * self.page_size)
            with memoryview(self._iota) as view:
                cut = range(len(pb) * size, self._fresh * size, size)
                pb += [view[i : i + size].tobytes() for i in cut]
        return b"".join(map(pb.__getitem__, pages))

    def _ids(self, lo: int, hi: int) -> array:
        """The ids lo, lo + 1, ..., hi - 1 (all below what ``_iota_to`` made), as an array."""
        out = array(SLOT_CODE)
        with memoryview(self._iota) as view:
            out.frombytes(view[lo * _W : hi * _W])
        return out

    def _slots_of(self, pages: array, n: int) -> array:
        """The first ``n`` slots of ``pages``, in order, sliced from the ids handed out so far
        (not one int object per slot): one slice when the pages are one ascending run, else
        one per page, gathered at C level (freed leaves come back scattered)."""
        p = self.page_size
        self._iota_to(self._fresh * p)
        lo, k = pages[0], len(pages)
        if pages[-1] == lo + k - 1 and (k <= 2 or self._ids(lo, lo + k) == pages):
            return self._ids(lo * p, lo * p + n)
        return self._gather(pages, n)

    def _mark(self, pages: array | list[int], flag: int) -> None:
        """Set the in-use flag of ``pages``: one slice if they are one ascending run; else, at
        page size > 1 or for a few pages, one flag at a time (scattered pages freed by
        eviction: looking for runs among them cost 4-8x the loop); at page size 1, one slice
        per ascending run (found by halving), a C-level map over the short pieces: a prompt's
        thousands of pages come back as a few runs (flag by flag was a third of the
        simulator's time on 512-token blocks)."""
        in_use, k, one = self._in_use, len(pages), b"\x01" if flag else b"\x00"
        if (
            k > MARK_PIECE
            and pages[-1] - pages[0] == k - 1
            and pages == self._ids(pages[0], pages[0] + k)
        ):
            in_use[pages[0] : pages[0] + k] = one * k  # one ascending run: one slice
            return
        if k <= MARK_PIECE or self.page_size > 1:  # a few pages, or pages of many tokens each
            for page in pages:  # (a prompt's hundreds at most): a loop costs less than
                in_use[page] = flag  # looking for runs among scattered ones
            return
        stack = [(0, k)]
        while stack:
            lo, hi = stack.pop()
            first = pages[lo]
            if pages[hi - 1] - first == hi - lo - 1 and (
                hi - lo <= 2 or pages[lo:hi] == self._ids(first, first + hi - lo)
            ):
                in_use[first : first + hi - lo] = one * (hi - lo)
            elif hi - lo <= MARK_PIECE:
                deque(map(in_use.__setitem__, pages[lo:hi], repeat(flag)), maxlen=0)
            else:
                mid = (lo + hi) // 2
                stack += ((mid, hi), (lo, mid))

    def free_runs(self, runs: Sequence[Sequence[int]]) -> None:
        """``free`` each of ``runs`` (an eviction's leaves: each usually one run of slots)."""
        for run in runs:
            self.free(run)

    def free(self, slots: Sequence[int]) -> None:
        """Return the pages holding ``slots`` (every slot of a page must be the caller's).
        Refused whole (SlotError) if any page is outside the pool or not in use."""
        if not len(slots):
            return
        if self._free_run(slots):
            return
        pages = self._pages_of(slots)
        lo, hi = pages[0], pages[-1]
        if not (0 <= lo and hi < self.num_pages):
            bad = next(pg for pg in pages if not 0 <= pg < self.num_pages)
            raise SlotError(f"slot page {bad} is outside the pool")
        in_use = self._in_use
        if not all(map(in_use.__getitem__, pages)):  # C-level scan
            bad = next(pg for pg in pages if not in_use[pg])
            raise SlotError(f"double free, or free of a never-allocated slot (page {bad})")
        self._mark(pages, 0)
        self._push_free(array(SLOT_CODE, pages))

    def _free_run(self, slots: Sequence[int]) -> bool:
        """Free ``slots`` at C speed if they are one ascending run of pages from a page's first
        slot (the last page may end early: its tail is the owner's), all in use (an evicted
        leaf, a finished request's own slots); False (nothing done) otherwise."""
        p, lo, n = self.page_size, slots[0], len(slots)
        hi = lo + n  # exclusive
        if lo < 0 or lo % p or hi * _W > len(self._iota) or slots[-1] != hi - 1:
            return False
        if type(slots) is not array or slots.typecode != SLOT_CODE:
            return False
        if not self._iota.startswith(slots, lo * _W):  # a memcmp in place
            return False
        first, end = lo // p, -(-hi // p)
        if self._in_use.find(0, first, end) >= 0:
            return False  # a page not in use: the slow path names it
        self._in_use[first:end] = bytes(end - first)
        self._push_free(slots if p == 1 else self._ids(first, end))
        return True

    def _push_free(self, pages: array) -> None:
        n = self._nfree
        self._free_buf[n : n + len(pages)] = pages  # same length: a copy in place
        self._nfree = n + len(pages)

    def _pages_of(self, slots: Sequence[int]) -> array | list[int]:
        """The distinct pages of ``slots``, ascending: an array at page size 1 (``_mark`` finds
        its runs), else a list (the checks and flags share its ints: no int made per pass)."""
        p = self.page_size
        if p == 1:
            return array(SLOT_CODE, sorted(set(slots)))
        pages: Iterable[int] | None = self._whole_pages(slots)
        if pages is None:
            pages = map(floordiv, slots, repeat(p))  # one int object per slot
        return sorted(set(pages))

    def _whole_pages(self, slots: Sequence[int]) -> list[int] | None:
        """The page of each ``p``-th slot, when ``slots`` are pages each from its first slot on
        (the last may end early): what a tree node or a request frees. Checked with one
        compare against the slots those pages hold, at a cost per page, not per slot (a list:
        its ints are made once, not at each pass over an array)."""
        p = self.page_size
        if type(slots) is not array or slots.typecode != SLOT_CODE:
            return None
        pages = [first // p for first in slots[::p]]
        if not pages or min(pages) < 0 or max(pages) >= self._fresh:  # slow path
            return None
        # the pages' own slots start with ``slots`` (a partial last page included): a memcmp
        if not self._page_bytes_of(pages).startswith(slots):
            return None
        return pages


@dataclass(slots=True)
class _Entry:
    slots: array  # array('q'): one per request, extended in place
    owned_from: int  # slots[:owned_from] belong to the radix cache, the rest to the request


class RequestSlotTable:
    """Request id -> KV slot of every position. A request's leading positions may be a cached
    prefix (owned by the radix cache, page aligned); the rest are the request's own slots."""

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self._entries: dict[str, _Entry] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def open(self, rid: str, prefix_slots: Sequence[int]) -> None:
        if rid in self._entries:
            raise SlotError(f"request {rid!r} already holds slots")
        if len(prefix_slots) % self.allocator.page_size:
            raise ValueError("a cached prefix must be whole pages")
        self._entries[rid] = _Entry(array(SLOT_CODE, prefix_slots), len(prefix_slots))

    def slots(self, rid: str) -> array:
        return self._entries[rid].slots

    def owned_from(self, rid: str) -> int:
        return self._entries[rid].owned_from

    def extend_cost(self, rid: str, n: int) -> int:
        """Fresh slots (whole pages) that ``extend(rid, n)`` would take from the allocator."""
        e = self._entries[rid]
        p = self.allocator.page_size
        short = n - (-(len(e.slots) - e.owned_from) % p)  # minus the room left in the last page
        return -(-short // p) * p if short > 0 else 0

    def extend_all(self, rids: Iterable[str], n: int) -> None:
        """``extend(rid, n)`` for each of ``rids``, in order (the same slots), allocating the
        new pages of all at once."""
        entries = [self._entries[rid] for rid in rids]
        p = self.allocator.page_size
        rooms = [min(-(len(e.slots) - e.owned_from) % p, n) for e in entries]
        fresh = self.allocator.alloc_many([n - room for room in rooms])
        for e, room, new in zip(entries, rooms, fresh):
            slots = e.slots
            if room:
                slots.extend(range(slots[-1] + 1, slots[-1] + 1 + room))
            slots += new

    def extend(self, rid: str, n: int) -> array:
        """Slots for ``n`` more positions: the rest of the last owned page first, then new pages."""
        e = self._entries[rid]
        slots = e.slots
        room = min(-(len(slots) - e.owned_from) % self.allocator.page_size, n)
        if room:
            new = array(SLOT_CODE, range(slots[-1] + 1, slots[-1] + 1 + room))
            if n > room:
                new += self.allocator.alloc(n - room)
        else:
            new = self.allocator.alloc(n)
        slots += new
        return new

    def adopt_prefix(self, rid: str, cached_slots: Sequence[int]) -> None:
        """After the request's first ``len(cached_slots)`` positions went into the radix cache:
        free the request's duplicates of slots the cache already had, and take the cache's."""
        e = self._entries[rid]
        n = len(cached_slots)
        if n % self.allocator.page_size or n > len(e.slots):
            raise ValueError("adopted prefix must be whole pages within the request")
        if n <= e.owned_from:
            return
        own, theirs = e.slots[e.owned_from : n], cached_slots[e.owned_from : n]
        if own != theirs:  # compared in C: usually the tree took the request's own slots
            self.allocator.free([s for s, c in zip(own, theirs) if s != c])
        e.slots[:n] = (
            cached_slots
            if type(cached_slots) is array and cached_slots.typecode == SLOT_CODE
            else array(SLOT_CODE, cached_slots)
        )
        e.owned_from = n

    def close(self, rid: str) -> array:
        """Forget the request and free its own slots; returns the cached prefix it had."""
        e = self._entries.pop(rid)
        own = e.slots[e.owned_from :]
        if own:
            self.allocator.free(own)
        return e.slots[: e.owned_from]

    def held(self) -> int:
        """Token slots (whole pages) held by requests, as the allocator counts them."""
        p = self.allocator.page_size
        return sum(
            self.allocator.pages_for(len(e.slots) - e.owned_from) * p
            for e in self._entries.values()
        )
