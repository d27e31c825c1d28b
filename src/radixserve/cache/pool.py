"""KV slot allocation: a page-granular free list of token slots, and the per-request slot table.

Slot ids index the model's KV tensors; pages are ``page_size`` consecutive slots. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class SlotError(RuntimeError):
    """A slot was freed twice, freed without being allocated, or the pool is exhausted."""


class SlotAllocator:
    """Hands out token slots in whole pages; ``page_size == 1`` makes it token-granular."""

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
        # popped from the end, so low slot ids go first
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._in_use = bytearray(self.num_pages)

    def available(self) -> int:
        """Free token slots (whole pages)."""
        return len(self._free_pages) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_tokens: int) -> list[int]:
        """Slots for ``num_tokens`` tokens, in ``ceil(num_tokens / page_size)`` fresh pages.
        The unused tail of the last page stays reserved for the same owner (see ``extend``)."""
        if num_tokens < 0:
            raise ValueError(f"cannot allocate {num_tokens} slots")
        pages = self.pages_for(num_tokens)
        if pages > len(self._free_pages):
            raise SlotError(f"out of KV slots: need {num_tokens}, have {self.available()}")
        p = self.page_size
        out: list[int] = []
        for _ in range(pages):
            page = self._free_pages.pop()
            self._in_use[page] = 1
            out.extend(range(page * p, page * p + p))
        return out[:num_tokens]

    def free(self, slots: Sequence[int]) -> None:
        """Return the pages holding ``slots`` (every slot of a page must be the caller's)."""
        pages = sorted({s // self.page_size for s in slots})
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise SlotError(f"slot page {page} is outside the pool")
            if not self._in_use[page]:
                raise SlotError(f"double free, or free of a never-allocated slot (page {page})")
        for page in pages:
            self._in_use[page] = 0
            self._free_pages.append(page)


@dataclass(slots=True)
class _Entry:
    slots: list[int]
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
        self._entries[rid] = _Entry(list(prefix_slots), len(prefix_slots))

    def slots(self, rid: str) -> list[int]:
        return self._entries[rid].slots

    def owned_from(self, rid: str) -> int:
        return self._entries[rid].owned_from

    def extend_cost(self, rid: str, n: int) -> int:
        """Fresh slots (whole pages) that ``extend(rid, n)`` would take from the allocator."""
        e = self._entries[rid]
        return self.allocator.page_size * self.allocator.pages_for(max(0, n - self._tail_room(e)))

    def _tail_room(self, e: _Entry) -> int:
        own = len(e.slots) - e.owned_from
        return -own % self.allocator.page_size

    def extend(self, rid: str, n: int) -> list[int]:
        """Slots for ``n`` more positions: the rest of the last owned page first, then new pages."""
        e = self._entries[rid]
        room = min(self._tail_room(e), n)
        new = list(range(e.slots[-1] + 1, e.slots[-1] + 1 + room)) if room else []
        new += self.allocator.alloc(n - room)
        e.slots.extend(new)
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
        own = e.slots[e.owned_from : n]
        dupes = [s for s, c in zip(own, cached_slots[e.owned_from :]) if s != c]
        if dupes:
            self.allocator.free(dupes)
        e.slots[:n] = cached_slots
        e.owned_from = n

    def close(self, rid: str) -> list[int]:
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
