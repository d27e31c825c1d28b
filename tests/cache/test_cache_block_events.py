"""BlockTracker on a real RadixCache: full blocks announced once with cache/hashing.py's chained
hashes, splits silent, evictions removed, namespaces apart, page_size > 1, and a random
sequence of operations against a recount of the tree."""

from __future__ import annotations

import itertools
import random

import pytest

from radixserve.cache.block_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTracker,
)
from radixserve.cache.hashing import block_hashes
from radixserve.cache.radix import RadixCache
from radixserve.config import CacheConfig


def make(page_size: int = 1, block_size: int = 4, **kw) -> tuple[RadixCache, BlockTracker]:
    cache = RadixCache(CacheConfig(page_size=page_size, max_total_tokens=1 << 20))
    return cache, BlockTracker(cache, block_size, **kw)


_slots = itertools.count()


def insert(cache: RadixCache, tokens: list[int], ns=None) -> None:
    cache.insert(tokens, [next(_slots) for _ in tokens], ns)


def stored(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_full_blocks_only_with_chained_hashes_and_parent_links():
    cache, tr = make(block_size=4)
    toks = list(range(1, 11))  # 10 tokens: two full blocks, 2 left over
    insert(cache, toks)
    (ev,) = tr.take()
    want = block_hashes(toks, 4, "xxhash64")
    assert ev.block_hashes == want and ev.parent_block_hash is None
    assert ev.token_ids == toks[:8] and ev.block_size == 4
    assert ev.wire()["type"] == "BlockStored" and ev.wire()["extra_keys"] == [None, None]
    # extending the path completes block 3 from the 2 leftover tokens and 2 new ones
    insert(cache, toks + [11, 12, 13])
    (ev,) = tr.take()
    assert ev.parent_block_hash == want[1]
    assert ev.token_ids == [9, 10, 11, 12]
    assert ev.block_hashes == block_hashes(toks + [11, 12, 13], 4, "xxhash64")[2:]
    tr.check()


def test_repeats_and_splits_announce_nothing_new():
    cache, tr = make(block_size=4)
    a = list(range(1, 13))
    insert(cache, a)
    first = tr.take()
    insert(cache, a)  # the same prompt again
    cache.match_prefix(a[:6])  # a match that splits the node mid-block
    insert(cache, a[:6] + [99, 98, 97, 96])  # a branch inside block 1: splits at 6
    events = tr.take()
    assert set(stored(events)).isdisjoint(stored(first))
    assert stored(events) == block_hashes(a[:6] + [99, 98, 97, 96], 4, "xxhash64")[1:]
    assert not removed(events)
    tr.check()


def test_eviction_removes_exactly_the_blocks_that_end_in_the_evicted_leaf():
    cache, tr = make(block_size=4)
    a, b = list(range(1, 13)), list(range(1, 7)) + [50, 51, 52, 53, 54, 55]
    insert(cache, a)
    insert(cache, b)
    tr.take()
    cache.evict(1)  # the least recently used leaf: a's tail (tokens 7..12)
    events = tr.take()
    ha = block_hashes(a, 4, "xxhash64")
    assert removed(events) == ha[1:]  # block 0 (1..4) stays, it ends in the shared node
    cache.evict(100)
    assert sorted(removed(tr.take())) == sorted([ha[0], *block_hashes(b, 4, "xxhash64")[1:]])
    assert tr.num_blocks == 0
    tr.check()


def test_reinsert_after_eviction_announces_again():
    cache, tr = make(block_size=2)
    insert(cache, [1, 2, 3, 4])
    h = stored(tr.take())
    cache.evict(100)
    assert removed(tr.take()) == h
    insert(cache, [1, 2, 3, 4])
    assert stored(tr.take()) == h


def test_namespaces_hash_apart_and_carry_the_salt():
    cache, tr = make(block_size=2)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 3, 4], "salt:tenant-a")
    plain, salted = tr.take()
    assert set(plain.block_hashes).isdisjoint(salted.block_hashes)
    assert salted.block_hashes == block_hashes([1, 2, 3, 4], 2, "xxhash64", 0, "salt:tenant-a")
    assert salted.extra_keys == [["tenant-a"], None] and salted.lora_name is None
    assert plain.extra_keys == [None, None]
    snap = list(tr.blocks())
    assert {b["block_hash"] for b in snap} == set(plain.block_hashes) | set(salted.block_hashes)
    tr.check()


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_sha256_hashes_published_as_their_last_8_bytes(algo):
    cache, tr = make(block_size=2, hash_algo=algo, hash_seed=7)
    insert(cache, [5, 6, 7, 8])
    (ev,) = tr.take()
    hexes = block_hashes([5, 6, 7, 8], 2, algo, 7)
    assert ev.block_hashes == [int(h[-16:], 16) for h in hexes]
    tr.check()


def test_page_size_above_one_and_bad_block_sizes():
    cache, tr = make(page_size=4, block_size=8)
    toks = list(range(1, 23))  # 22 tokens: 20 cached (whole pages), 2 blocks of 8
    insert(cache, toks)
    assert stored(tr.take()) == block_hashes(toks[:20], 8, "xxhash64")
    insert(cache, toks[:12] + [70] * 12)  # a branch at a page boundary inside block 1
    assert stored(tr.take()) == block_hashes(toks[:12] + [70] * 12, 8, "xxhash64")[1:]
    tr.check()
    with pytest.raises(ValueError, match="multiple of the page size"):
        BlockTracker(RadixCache(CacheConfig(page_size=4)), 6)
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockTracker(RadixCache(), 4, "md5")


def test_clear_after_reset():
    cache, tr = make(block_size=2)
    insert(cache, [1, 2, 3])
    cache.reset()
    tr.clear()
    assert isinstance(tr.take()[-1], AllBlocksCleared) and tr.num_blocks == 0
    insert(cache, [1, 2, 3])
    assert stored(tr.take()) == block_hashes([1, 2, 3], 2, "xxhash64")
    tr.check()


@pytest.mark.parametrize("page_size,block_size", [(1, 3), (2, 4), (4, 4)])
def test_random_operations_keep_the_events_equal_to_the_tree(page_size, block_size):
    """Replaying the events into a set gives the tree's blocks at every point, no block is
    stored twice without a removal between, and the tracker's recount holds."""
    rng = random.Random(page_size * 100 + block_size)
    cache, tr = make(page_size, block_size)
    held: set[int] = set()
    for _ in range(300):
        op = rng.random()
        ns = rng.choice([None, "salt:x"])
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
        if op < 0.5:
            insert(cache, toks, ns)
        elif op < 0.8:
            cache.match_prefix(toks, ns)
        else:
            cache.evict(rng.randrange(1, 20))
        for ev in tr.take():
            if isinstance(ev, BlockStored):
                assert held.isdisjoint(ev.block_hashes), "a block announced twice"
                held.update(ev.block_hashes)
            else:
                assert set(ev.block_hashes) <= held, "removal of a block never stored"
                held.difference_update(ev.block_hashes)
        assert held == {b["block_hash"] for b in tr.blocks()}
        assert len(held) == tr.num_blocks
    tr.check()
    cache.check_integrity()


# -- the host tier: medium "CPU" ----------------------------------------------------------------
def test_host_copies_are_announced_with_medium_cpu() -> None:
    from radixserve.cache.pool import SlotAllocator
    from radixserve.cache.tiers import HostTier

    cache = RadixCache(CacheConfig(max_total_tokens=64), HostTier(128, 1, "write_through"))
    alloc = SlotAllocator(64)
    tracker = BlockTracker(cache, block_size=4)
    tokens = list(range(100, 112))
    cache.insert(tokens, alloc.alloc(12))
    stored = tracker.take()
    assert [(type(e).__name__, e.medium) for e in stored] == [("BlockStored", "GPU"),
                                                               ("BlockStored", "CPU")]  # fmt: skip
    gpu, cpu = stored
    assert cpu.block_hashes == gpu.block_hashes and cpu.token_ids == gpu.token_ids
    alloc.free_runs(cache.evict_runs(12))  # off the device, kept on the host
    assert [(type(e).__name__, e.medium) for e in tracker.take()] == [("BlockRemoved", "GPU")]
    cache.evict_host(12)  # and off the host
    [removed] = tracker.take()
    assert removed.medium == "CPU" and removed.block_hashes == gpu.block_hashes
    # pages fetched from the storage tier land on the host: announced there
    cache.insert_host(tokens, cache.alloc_host(12), None)
    [landed] = tracker.take()
    assert landed.medium == "CPU" and landed.block_hashes == gpu.block_hashes
    assert landed.wire()["medium"] == "CPU"
