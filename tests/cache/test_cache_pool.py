"""Slot allocator and request slot table: exact accounting and clear errors."""

from __future__ import annotations

import random
from array import array

import pytest

from radixserve.cache.pool import RequestSlotTable, SlotAllocator, SlotError
from radixserve.cache.tokens import SLOT_CODE, slot_iota


def test_token_granular_alloc_free() -> None:
    alloc = SlotAllocator(8)
    a = alloc.alloc(5)
    assert len(set(a)) == 5 and alloc.available() == 3
    alloc.free(a[:2])
    assert alloc.available() == 5


def test_paged_alloc_takes_whole_pages() -> None:
    alloc = SlotAllocator(64, page_size=16)
    slots = alloc.alloc(17)
    assert len(slots) == 17 and alloc.available() == 32
    assert list(slots[:16]) == list(range(slots[0], slots[0] + 16))
    alloc.free(slots)
    assert alloc.available() == 64


@pytest.mark.parametrize("page_size", [1, 4])
def test_errors_are_clear(page_size: int) -> None:
    alloc = SlotAllocator(8, page_size)
    slots = alloc.alloc(4)
    alloc.free(slots)
    with pytest.raises(SlotError, match="double free"):
        alloc.free(slots)
    with pytest.raises(SlotError, match="outside the pool"):
        alloc.free([100])
    with pytest.raises(SlotError, match="out of KV slots"):
        alloc.alloc(9)
    assert alloc.available() == 8


def test_request_table_extends_within_last_page() -> None:
    alloc = SlotAllocator(32, page_size=4)
    table = RequestSlotTable(alloc)
    table.open("r", [])
    first = table.extend("r", 3)
    assert table.extend_cost("r", 1) == 0  # room left in the page
    nxt = table.extend("r", 1)
    assert list(nxt) == [first[-1] + 1]
    assert table.extend_cost("r", 1) == 4
    table.extend("r", 1)
    assert table.held() == 8 and alloc.available() == 24
    table.close("r")
    assert alloc.available() == 32 and len(table) == 0


def test_adopt_prefix_frees_duplicates() -> None:
    alloc = SlotAllocator(16)
    table = RequestSlotTable(alloc)
    cached = alloc.alloc(2)  # held by "the cache"
    table.open("r", [])
    own = table.extend("r", 4)
    table.adopt_prefix("r", cached + own[2:3])  # cache had 2 already; took one more of ours
    assert table.slots("r") == cached + own[2:]
    assert table.held() == 1
    assert alloc.available() == 16 - 2 - 2  # our two duplicates went back to the pool
    table.close("r")
    assert alloc.available() == 16 - 2 - 1


def test_open_twice_is_an_error() -> None:
    table = RequestSlotTable(SlotAllocator(4))
    table.open("r", [])
    with pytest.raises(SlotError):
        table.open("r", [])


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_run_with_one_freed_page_inside_is_refused_whole(page_size: int) -> None:
    alloc = SlotAllocator(64, page_size)
    run = alloc.alloc(32)
    alloc.free(run[8:12])  # one page (or four slots) of the run goes back first
    before = alloc.available()
    with pytest.raises(SlotError, match="double free"):
        alloc.free(run)  # freeing the whole run again would free that page twice
    assert alloc.available() == before  # refused whole: nothing of the run was freed
    alloc.free(run[:8] + run[12:])
    assert alloc.available() == 64
    again = alloc.alloc(64)
    assert sorted(again) == list(range(64))  # every slot comes back exactly once


@pytest.mark.parametrize(
    "lo,hi",
    [
        (0, 0),
        (0, 63),
        (0, 64),
        (5, 4101),
        (4096, 4096 * 3 + 17),
        (2**62, 2**62 + 5000),
        (65_000, 3 * 65_536 + 9),
        (2**32 - 70_000, 2**32 + 70_000),
        (2**63 - 300, 2**63 - 1),
    ],
)
def test_slot_iota_is_the_ids_in_order(lo: int, hi: int) -> None:
    assert slot_iota(lo, hi) == array(SLOT_CODE, range(lo, hi)).tobytes()


def test_a_large_pool_filled_a_page_at_a_time_hands_out_every_slot_once() -> None:
    # the host tier's case: ids built in steps as the pool fills, never repeated or skipped
    alloc = SlotAllocator(70_000, 16)
    slots = array(SLOT_CODE)
    while alloc.available():
        slots += alloc.alloc(min(16 * 7, alloc.available()))
    assert slots == array(SLOT_CODE, range(70_000 - 70_000 % 16))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_many_hands_out_what_one_alloc_each_would(page_size: int) -> None:
    """A decode run allocates for all its requests at once: the same slots, the same pool."""
    rng = random.Random(page_size)
    one, many = SlotAllocator(4096, page_size), SlotAllocator(4096, page_size)
    held: list[array] = []
    for _ in range(400):
        if held and rng.random() < 0.45:  # scatter the free list as finished requests do
            run = held.pop(rng.randrange(len(held)))
            one.free(run), many.free(run)
            continue
        counts = [rng.choice([0, 1, 3, page_size, page_size + 1, 40]) for _ in range(4)]
        if sum(-(-n // page_size) for n in counts) * page_size > one.available():
            continue
        got = many.alloc_many(counts)
        assert got == [one.alloc(n) for n in counts]
        held += got
        assert one.available() == many.available()
    for run in held:
        one.free(run), many.free(run)
    assert one.available() == many.available() == 4096
