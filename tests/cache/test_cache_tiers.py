"""The radix tree's host tier: a hypothesis state machine that moves simulated KV bytes by the
copies the tree asks for and checks that every cached prefix, on either tier, holds the bytes
its tokens computed; plus the write policies' rules one by one."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache.pool import SlotAllocator
from radixserve.cache.radix import RadixCache, path_slots
from radixserve.cache.tiers import HostTier
from radixserve.config import CacheConfig
from test_cache_radix import prompts

BASES = [[7] * 40, [1, 2] * 20, [3, 1, 4, 1, 5] * 8]


def kv_of(prefix: list[int]) -> int:
    """The 'KV' a forward computes for the last token of ``prefix`` (depends on all of it)."""
    return hash(tuple(prefix))


class TieredMachine(RuleBasedStateMachine):
    page_size = 1
    max_len = 40
    policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        p = self.page_size
        device = 6 * self.max_len * p
        self.host = HostTier(2 * device, p, self.policy)
        self.cache = RadixCache(CacheConfig(page_size=p, max_total_tokens=device), self.host)
        self.alloc = SlotAllocator(device, p)
        self.dev = [None] * device  # the device pool's bytes, by slot
        self.hbytes = [None] * self.host.total
        self.running: list[tuple[list[int], array, object]] = []
        self.pinned: list[tuple[list[int], array, object]] = []  # the storage writer's reads
        self.host_hits = 0

    def apply_copies(self) -> None:
        for c in self.host.take_copies():
            for d, h in zip(c.device, c.host):
                if c.kind == "store":
                    self.hbytes[h] = self.dev[d]
                else:
                    self.dev[d] = self.hbytes[h]

    def make_room(self, n: int) -> bool:
        short = n - self.alloc.available()
        if short > 0:
            self.alloc.free_runs(self.cache.evict_runs(short))
        return self.alloc.available() >= n

    @rule(tokens=prompts(max_len, BASES))
    def start_request(self, tokens: list[int]) -> None:
        m = self.cache.match_prefix(tokens)
        node, length = m.last_node, m.length
        self.cache.lock(node)
        chain = self.cache.match_host(tokens, node, length, len(tokens))
        if chain:
            n = sum(len(c.key) for c in chain)
            self.cache.pin_host(chain, 1)
            if self.make_room(n):
                self.cache.load(chain, self.alloc.alloc(n))
                # the lock on node plus the pins on chain are now one lock on chain[-1]
                node, length = chain[-1], length + n
                self.host_hits += n
            else:
                self.cache.pin_host(chain, -1)
        slots = self.cache.match_prefix(tokens).slots[:length] if length else array("q")
        need = self.alloc.pages_for(len(tokens) - length) * self.page_size
        if not self.make_room(need):
            self.cache.unlock(node)
            return
        slots += self.alloc.alloc(len(tokens) - length)
        self.apply_copies()  # before the forward writes the new slots
        for i in range(length, len(tokens)):
            self.dev[slots[i]] = kv_of(tokens[: i + 1])
        self.running.append((tokens, slots, node))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        tokens, slots, node = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        end = len(tokens) - len(tokens) % self.page_size
        self.cache.insert(tokens, slots)
        m = self.cache.match_prefix(tokens)
        assert m.length == end, "an inserted prompt is not wholly on the device"
        own = set(slots) - set(m.slots)
        if own:
            self.alloc.free(sorted(own))
        self.cache.unlock(node)
        self.apply_copies()

    @rule(tokens=prompts(max_len, BASES))
    def pin_for_the_writer(self, tokens: list[int]) -> None:
        """The storage tier offers a prompt: its device prefix (read only) is pinned until the
        writer thread has read it; it agrees with what a match finds."""
        node, length = self.cache.device_prefix(tokens)
        self.cache.lock(node)
        slots = path_slots(node)[:length]
        m = self.cache.match_prefix(tokens)
        assert length == m.length and slots == m.slots[:length]
        self.pinned.append((tokens[:length], slots, node))

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def the_writer_reads(self, data: st.DataObject) -> None:
        """Whatever was evicted and recomputed meanwhile, the pinned slots hold their bytes."""
        tokens, slots, node = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        self.apply_copies()
        for i, slot in enumerate(slots):
            assert self.dev[slot] == kv_of(tokens[: i + 1]), "a pinned page changed"
        self.cache.unlock(node)

    @rule(n=st.integers(0, 120))
    def evict(self, n: int) -> None:
        self.alloc.free_runs(self.cache.evict_runs(n))
        self.apply_copies()

    @rule(n=st.integers(0, 120))
    def evict_host(self, n: int) -> None:
        self.cache.evict_host(n)

    @invariant()
    def both_tiers_hold_the_right_bytes(self) -> None:
        c = self.cache
        c.check_integrity()
        held = self.alloc.total - self.alloc.available() - c.evictable_size() - c.protected_size()
        assert held >= 0, "the tree holds slots the allocator thinks are free"
        self.apply_copies()
        stack = [(child, []) for child in c.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key.tolist()
            for i in range(len(node.key)):
                want = kv_of(path[: len(prefix) + i + 1])
                if node.value is not None:
                    assert self.dev[node.value[i]] == want, "device bytes of a cached prefix"
                if node.host is not None:
                    assert self.hbytes[node.host[i]] == want, "host bytes of a cached prefix"
            stack.extend((child, path) for child in node.children.values())


class TieredPaged(TieredMachine):
    page_size = 4


def _case(policy: str, base: type[TieredMachine]) -> type:
    case = type(f"{base.__name__}_{policy}", (base,), {"policy": policy}).TestCase
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    return case


TestWriteThrough = _case("write_through", TieredMachine)
TestWriteThroughSelective = _case("write_through_selective", TieredMachine)
TestWriteBack = _case("write_back", TieredMachine)
TestWriteThroughPaged = _case("write_through", TieredPaged)
TestWriteBackPaged = _case("write_back", TieredPaged)


# -- the policies, one by one ---------------------------------------------------------------------
def tiered(policy: str, device: int = 64, host: int = 128) -> tuple[RadixCache, SlotAllocator]:
    tier = HostTier(host, 1, policy)
    return RadixCache(CacheConfig(max_total_tokens=device), tier), SlotAllocator(device)


def cache_one(cache: RadixCache, alloc: SlotAllocator, tokens: list[int]) -> None:
    cache.insert(tokens, alloc.alloc(len(tokens)))


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_prefix_stays_matchable_on_host(policy: str) -> None:
    cache, alloc = tiered(policy)
    cache_one(cache, alloc, list(range(100, 120)))
    alloc.free_runs(cache.evict_runs(20))
    assert cache.evictable_size() == 0 and cache.host_only_size() == 20
    m = cache.match_prefix(list(range(100, 130)))
    assert m.length == 0  # nothing on the device
    chain = cache.match_host(list(range(100, 130)), m.last_node, 0, 30)
    assert sum(len(n.key) for n in chain) == 20
    cache.check_integrity()


def test_write_through_copies_on_insert_and_drops_nothing_on_evict() -> None:
    cache, alloc = tiered("write_through")
    cache_one(cache, alloc, [5] * 10)
    copies = cache.host.take_copies()
    assert [c.kind for c in copies] == ["store"] and len(copies[0].host) == 10
    alloc.free_runs(cache.evict_runs(10))
    assert cache.host.take_copies() == []  # already on the host: eviction copies nothing


def test_write_back_copies_only_when_evicted() -> None:
    cache, alloc = tiered("write_back")
    cache_one(cache, alloc, [5] * 10)
    assert cache.host.take_copies() == []
    alloc.free_runs(cache.evict_runs(10))
    assert [c.kind for c in cache.host.take_copies()] == ["store"]
    assert cache.host_only_size() == 10


def test_write_through_selective_keeps_only_what_was_hit_twice() -> None:
    cache, alloc = tiered("write_through_selective")
    cache_one(cache, alloc, [1] * 10)
    cache_one(cache, alloc, [2] * 10)
    cache.match_prefix([2] * 10)  # second use of the [2] prefix
    assert [len(c.host) for c in cache.host.take_copies()] == [10]
    alloc.free_runs(cache.evict_runs(20))
    assert cache.host_only_size() == 10  # [1] * 10 was dropped, [2] * 10 kept
    assert cache.match_host([1] * 10, cache.namespace_root(None), 0, 10) == []
    cache.check_integrity()


def test_full_host_evicts_host_only_leaves_lru() -> None:
    cache, alloc = tiered("write_back", device=20, host=20)
    cache_one(cache, alloc, [1] * 10)
    cache_one(cache, alloc, [2] * 10)
    alloc.free_runs(cache.evict_runs(20))  # both to the host: it is full
    cache_one(cache, alloc, [3] * 10)
    alloc.free_runs(cache.evict_runs(10))  # needs host room: [1] (least recent) goes
    root = cache.namespace_root(None)
    assert cache.match_host([1] * 10, root, 0, 10) == []
    assert len(cache.match_host([3] * 10, root, 0, 10)) == 1
    cache.check_integrity()


def test_insert_through_a_host_node_takes_the_fresh_slots() -> None:
    cache, alloc = tiered("write_through")
    cache_one(cache, alloc, [4] * 8)
    alloc.free_runs(cache.evict_runs(8))
    slots = alloc.alloc(12)
    assert cache.insert([4] * 12, slots) == 0  # none of it was on the device
    assert list(cache.match_prefix([4] * 12).slots) == list(slots)
    assert cache.host_only_size() == 0 and cache.host_size() == 12
    cache.check_integrity()


def test_unplaced_config_refuses_unknown_policy() -> None:
    with pytest.raises(ValueError, match="write policy"):
        HostTier(10, 1, "write_around")


# -- pages from the storage tier (insert_host) ----------------------------------------------------
def test_insert_host_hangs_storage_pages_below_what_either_tier_holds() -> None:
    cache, alloc = tiered("write_through")
    cache_one(cache, alloc, list(range(100, 110)))
    alloc.free_runs(cache.evict_runs(6))  # the leaf leaves the device: kept on the host
    tokens = list(range(100, 130))
    assert cache.cached_len(tokens) == 10  # read only: both tiers, nothing split
    slots = cache.alloc_host(20)
    assert cache.insert_host(tokens, slots, None, start=10) == 20
    assert cache.cached_len(tokens) == 30
    m = cache.match_prefix(tokens)
    chain = cache.match_host(tokens, m.last_node, m.length, 30)
    assert m.length == 0 and sum(len(n.key) for n in chain) == 30  # evicted part + fetched
    cache.check_integrity()


def test_insert_host_frees_the_slots_of_what_is_held_or_cannot_hang() -> None:
    cache, alloc = tiered("write_through", host=128)
    cache_one(cache, alloc, list(range(10)))
    free = cache.host.allocator.available()
    # positions 5..14: 5..9 are held (their slots freed), 10..14 are new
    assert cache.insert_host(list(range(15)), cache.alloc_host(10), None, start=5) == 5
    assert cache.host.allocator.available() == free - 5
    # a gap before start: the pages cannot hang anywhere, nothing inserted, all slots freed
    assert cache.insert_host(list(range(50, 70)), cache.alloc_host(10), None, start=10) == 0
    assert cache.host.allocator.available() == free - 5
    cache.check_integrity()
    assert cache.evict_host(100) == 5  # the fetched host-only leaf is evictable like any other
    cache.check_integrity()
