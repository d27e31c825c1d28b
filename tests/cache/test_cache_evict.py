"""Eviction policies and the eviction heap: order, bulk frees, no tree walk, integrity."""

from __future__ import annotations

from array import array

import pytest

from radixserve.cache.evict import POLICIES
from radixserve.cache.pool import SlotAllocator
from radixserve.cache.radix import RadixCache
from radixserve.config import CacheConfig


def make(policy: str) -> RadixCache:
    return RadixCache(CacheConfig(radix_eviction_policy=policy))


def test_every_policy_is_a_config_choice() -> None:
    import dataclasses

    from radixserve.config import choices_of

    field = next(f for f in dataclasses.fields(CacheConfig) if f.name == "radix_eviction_policy")
    assert set(choices_of(field.metadata["choices"])) == set(POLICIES)


@pytest.mark.parametrize(
    "policy, first",
    [
        ("lru", [2, 3]),
        ("lfu", [4, 5]),
        ("fifo", [0, 1]),
        ("mru", [4, 5]),  # [3, 3] was inserted (accessed) last
        ("filo", [4, 5]),
        ("priority", [2, 3]),  # all priority 0: least recently used first
        ("hit-benefit", [4, 5]),  # [3, 3]: one hit (its insertion), and the fewest
    ],
)
def test_which_leaf_goes_first(policy: str, first: list[int]) -> None:
    cache = make(policy)
    cache.insert([1, 1], [0, 1])  # oldest
    cache.insert([2, 2], [2, 3])
    cache.match_prefix([2, 2])  # used once, before [1, 1] is used thrice
    for _ in range(3):
        cache.match_prefix([1, 1])  # [1, 1] becomes most recent and most used
    cache.insert([3, 3], [4, 5])
    assert list(cache.evict(1)) == first
    cache.check_integrity()


def test_mru_evicts_what_was_just_matched() -> None:
    cache = make("mru")
    cache.insert([1, 1], [0, 1])
    cache.insert([2, 2], [2, 3])
    cache.match_prefix([1, 1])  # an access makes it the most recent: first to go under mru
    assert list(cache.evict(1)) == [0, 1]
    cache.check_integrity()


def test_priority_keeps_the_high_priority_prefix_however_old() -> None:
    cache = make("priority")
    cache.insert([1] * 8, range(8), priority=5)  # old, but a high-priority request's
    cache.insert([2] * 8, range(8, 16), priority=0)
    cache.insert([3] * 8, range(16, 24), priority=1)
    assert list(cache.evict(8)) == list(range(8, 16))
    assert list(cache.evict(8)) == list(range(16, 24))
    assert cache.match_prefix([1] * 8).length == 8
    # a later insert of a lower priority does not lower a node's priority (SGLang's rule)
    cache.insert([1] * 8, range(8), priority=0)
    cache.insert([4] * 8, range(24, 32), priority=2)
    assert list(cache.evict(8)) == list(range(24, 32))
    cache.check_integrity()


def test_hit_benefit_keeps_a_hot_prefix_that_lru_would_evict() -> None:
    """Five matches (waiting requests tracked by the prefix index do this) make a prefix
    worth more than a one-off inserted after them: lru evicts the hot one, hit-benefit not."""
    got = {}
    for policy in ("lru", "hit-benefit"):
        cache = make(policy)
        cache.insert([7] * 100, range(100))
        for _ in range(5):
            cache.match_prefix([7] * 100 + [1])
        cache.insert([8] * 100, range(100, 200))  # a one-off, touched last
        got[policy] = cache.evict(1)[0]
        cache.check_integrity()
    assert got == {"lru": 0, "hit-benefit": 100}


def test_hit_benefit_weighs_tokens_saved() -> None:
    """One hit on a long leaf saves more than one hit on a short one."""
    cache = make("hit-benefit")
    cache.insert([1] * 64, range(64))
    cache.insert([2] * 4, range(64, 68))
    cache.match_prefix([1] * 64)
    cache.match_prefix([2] * 4)
    assert list(cache.evict(1)) == [64, 65, 66, 67]


def test_hit_benefit_decays() -> None:
    """Old hits count less than new ones: a prefix hit often long ago goes before one hit
    a few times just now."""
    cache = make("hit-benefit")
    cache.insert([1] * 10, range(10))
    for _ in range(4):
        cache.match_prefix([1] * 10)
    for _ in range(20_000):  # five half-lives of other traffic (misses)
        cache.match_prefix([9])
    cache.insert([2] * 10, range(10, 20))
    cache.match_prefix([2] * 10)
    assert list(cache.evict(1)) == list(range(10))


def test_evict_returns_one_array_and_never_walks_the_tree() -> None:
    """O(log n) a leaf: eviction pops a heap; a walk over every node (``_nodes``) would make
    its cost grow with the tree, so here it raises."""
    cache = make("lru")
    for i in range(2000):
        cache.insert([i + 1, 5, 6, 7], range(4 * i, 4 * i + 4))
    cache.check_integrity()

    def no_walk() -> list:
        raise AssertionError("eviction walked the whole tree")

    cache._nodes = no_walk  # type: ignore[method-assign]
    freed = cache.evict(4 * 300)
    assert type(freed) is array and freed.typecode == "q"
    assert list(freed) == list(range(1200))  # oldest first, leaf by leaf
    del cache._nodes
    cache.check_integrity()


def test_freed_slots_go_back_to_the_allocator_in_bulk() -> None:
    alloc = SlotAllocator(4096)
    cache = make("lru")
    for i in range(100):
        cache.insert([i + 1] * 30, alloc.alloc(30))
    assert alloc.available() == 4096 - 3000
    alloc.free(cache.evict(3000))
    assert alloc.available() == 4096 and cache.total_size() == 0
    cache.check_integrity()


def test_locked_leaves_rejoin_the_heap_when_unlocked() -> None:
    cache = make("lru")
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([4, 5, 6], [3, 4, 5])
    hit = cache.match_prefix([1, 2, 3])
    cache.lock(hit.last_node)
    assert list(cache.evict(100)) == [3, 4, 5]  # the locked one waits
    cache.check_integrity()
    cache.unlock(hit.last_node)
    cache.check_integrity()
    assert list(cache.evict(100)) == [0, 1, 2]


def test_check_integrity_recounts_the_heap() -> None:
    cache = make("lru")
    cache.insert([1, 2, 3], [0, 1, 2])
    leaf = cache.match_prefix([1, 2, 3]).last_node
    leaf.hseq = None  # the heap lost this evictable leaf
    with pytest.raises(AssertionError, match="heap|stale"):
        cache.check_integrity()


def test_stale_entries_are_bounded() -> None:
    """mru pushes a fresh entry on every access; the stale ones are dropped in bulk."""
    cache = make("mru")
    cache.insert([1, 2, 3], [0, 1, 2])
    for _ in range(10_000):
        cache.match_prefix([1, 2, 3])
    assert len(cache._evq._heap) < 3000
    cache.check_integrity()
