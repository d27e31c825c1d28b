"""Room in the host tier for pages from the store (``host_room`` / ``land_slots``): under
write-through a host tier little larger than the device pool is all copies of device pages, and
a prefetch must still land, taking those copies first, never a copy a pending page copy still
writes, never the path it hangs below; plus a state machine where landings happen between a
finished request's insert and the copies it queued, as in the engine."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from radixserve.cache.pool import SlotAllocator
from radixserve.cache.radix import RadixCache
from radixserve.cache.tiers import HostTier
from radixserve.config import CacheConfig
from test_cache_radix import prompts
from test_cache_tiers import BASES, TieredMachine, cache_one, kv_of, tiered


def full_write_through(device: int = 64, host: int = 80) -> tuple[RadixCache, object]:
    """Three 20-token prompts cached: the device pool holds 60, the host tier their 60 copies
    (20 host slots free, no host-only leaf)."""
    cache, alloc = tiered("write_through", device, host)
    for base in (100, 200, 300):
        cache_one(cache, alloc, list(range(base, base + 20)))
    cache.host.take_copies()  # applied: the forward ran
    return cache, alloc


def test_a_prefetch_larger_than_the_free_host_slots_lands_on_spare_copies() -> None:
    """40 tokens from the store with 20 host slots free: the old way (``alloc_host``: free slots
    and host-only leaves only) finds no room, so nothing would land; the host copies of device
    pages make the room, the device keeps every prompt."""
    cache, _ = full_write_through()
    fetched = list(range(900, 940))
    assert cache.alloc_host(40) is None  # what a landing got before: nothing
    assert cache.host_room(40) == 40
    slots = cache.land_slots(fetched, 0, 40, 4)
    assert len(slots) == 40
    assert cache.insert_host(fetched, slots) == 40
    assert cache.cached_len(fetched) == 40 and cache.host_only_size() == 40
    for base in (100, 200, 300):  # every prompt still a device hit
        assert cache.match_prefix(list(range(base, base + 20))).length == 20
    assert cache.host_size() == 80  # 40 landed + the 40 copies not needed for them
    cache.check_integrity()


def test_the_most_recently_used_device_pages_give_up_their_copies_first() -> None:
    cache, _ = full_write_through()
    cache.match_prefix(list(range(100, 120)))  # the oldest prompt is now the most recent
    cache.free_host(cache.land_slots(list(range(900, 940)), 0, 40, 4))  # 20 free + one copy
    root = cache.namespace_root(None)
    backed = {n.key[0]: n.host is not None for n in root.children.values()}
    assert backed == {100: False, 200: True, 300: True}
    cache.check_integrity()


def test_a_landing_gets_whole_units_of_the_room_there_is() -> None:
    """Room for 70 of 80 wanted tokens, in units of 16: 64 slots, the rest not taken."""
    cache, _ = full_write_through(host=70)
    assert cache.host_room(80) == 70
    slots = cache.land_slots(list(range(900, 980)), 0, 80, 16)
    assert len(slots) == 64
    cache.free_host(slots)
    cache.check_integrity()


def test_a_copy_with_host_only_pages_below_is_kept() -> None:
    """[1]*10 is on the device with host-only [2]*10 below it: dropping its copy would lose
    that subtree when the device evicts it, so the landing evicts the host-only leaf instead."""
    cache, alloc = tiered("write_through", device=64, host=40)
    cache_one(cache, alloc, [1] * 10 + [2] * 10)
    cache_one(cache, alloc, [1] * 10 + [3] * 10)
    cache.host.take_copies()
    alloc.free_runs(cache.evict_runs(10))  # the lru leaf, [2]*10, goes to the host only
    assert cache.host_only_size() == 10 and cache.host_size() == 30
    assert cache.host_room(40) == 30  # 10 free, 10 host-only, [3]*10's copy; not [1]*10's
    slots = cache.land_slots(list(range(900, 930)), 0, 30, 10)
    assert len(slots) == 30
    root = cache.namespace_root(None)
    ones = root.children[1]
    assert cache.match_host([1] * 10 + [2] * 10, ones, 10, 20) == []  # evicted, lru
    assert cache.match_prefix([1] * 10 + [3] * 10).length == 20  # the device keeps both
    cache.free_host(slots)
    cache.check_integrity()


def test_a_copy_still_to_be_written_is_never_dropped() -> None:
    """A prompt cached since the last forward: its store copy is pending, so its host slots
    are not free to take (the landing writes now; the copy would overwrite it later)."""
    cache, alloc = full_write_through(host=64)  # 4 free
    cache_one(cache, alloc, [7] * 4)  # its copy pending: the 4 free slots are its now
    pending = set(cache.host.copies[0].host)
    slots = cache.land_slots(list(range(900, 980)), 0, 80, 4)
    assert len(slots) == 60 and pending.isdisjoint(slots)
    cache.free_host(slots)
    cache.check_integrity()


def test_the_path_a_landing_hangs_below_is_kept() -> None:
    """Pages 10..30 land below a host-only 0..10 while the host tier is full of host-only
    leaves: the old room-making could evict 0..10 itself, leaving the pages nowhere to hang."""
    cache, alloc = tiered("write_back", device=20, host=20)
    cache_one(cache, alloc, list(range(10)))
    cache_one(cache, alloc, list(range(50, 60)))
    alloc.free_runs(cache.evict_runs(20))
    cache.host.take_copies()
    tokens = list(range(20))
    slots = cache.land_slots(tokens, 10, 20, 10)
    assert len(slots) == 10
    assert cache.insert_host(tokens, slots, None, start=10) == 10
    assert cache.cached_len(tokens) == 20
    cache.check_integrity()


class LandingMachine(TieredMachine):
    """The tiered state machine with a host tier 1.25x the device pool and prefetches that
    land (their bytes written at once, as the engine does) right after a request finished and
    before the copies its insert queued have run."""

    host_ratio = 1.25

    def __init__(self) -> None:
        super().__init__()
        p = self.page_size
        device = 2 * self.max_len  # small: it fills, so the host tier is all copies often
        self.alloc = SlotAllocator(device, p)
        self.dev = [None] * device
        self.host = HostTier(int(device * self.host_ratio), p, self.policy)
        self.cache = RadixCache(CacheConfig(page_size=p, max_total_tokens=device), self.host)
        self.hbytes = [None] * self.host.total
        self.landed = 0

    @precondition(lambda self: self.running)
    @rule(data=st.data(), tokens=prompts(TieredMachine.max_len, BASES))
    def finish_then_land(self, data: st.DataObject, tokens: list[int]) -> None:
        slots_of, slots, node = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.cache.insert(slots_of, slots)
        m = self.cache.match_prefix(slots_of)
        own = set(slots) - set(m.slots)
        if own:
            self.alloc.free(sorted(own))
        self.cache.unlock(node)
        self.land(tokens)  # before apply_copies: the store copies of the insert still pend

    def land(self, tokens: list[int]) -> None:
        """The storage tier's ``_land``: slots, the bytes written now, the nodes inserted."""
        p = self.page_size
        end = len(tokens) - len(tokens) % p
        start = self.cache.cached_len(tokens[:end])
        if start >= end:
            return
        slots = self.cache.land_slots(tokens, start, end, p)
        for i, h in enumerate(slots):
            self.hbytes[h] = kv_of(tokens[: start + i + 1])
        assert len(slots) <= end - start and len(slots) % p == 0, "slots beyond what was asked"
        self.landed += self.cache.insert_host(tokens[: start + len(slots)], slots, None, start)

    @rule(tokens=prompts(TieredMachine.max_len, BASES))
    def prefetch_lands(self, tokens: list[int]) -> None:
        self.land(tokens)


class LandingPaged(LandingMachine):
    page_size = 4


def _case(policy: str, base: type[LandingMachine]) -> type:
    case = type(f"{base.__name__}_{policy}", (base,), {"policy": policy}).TestCase
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    return case


TestLandingWriteThrough = _case("write_through", LandingMachine)
TestLandingWriteBack = _case("write_back", LandingMachine)
TestLandingWriteThroughPaged = _case("write_through", LandingPaged)
