"""RadixCache against a naive reference model, driven by a hypothesis state machine."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache.evict import POLICIES
from radixserve.cache.pool import SlotAllocator
from radixserve.cache.radix import RadixCache
from radixserve.config import CacheConfig

BASES = [[0] * 40, [1, 2] * 20, [3, 1, 4, 1, 5] * 8]


def prompts(max_len: int, bases: list[list[int]] = BASES) -> st.SearchStrategy[list[int]]:
    """Prompts that share prefixes often: a slice of a base sequence (40 tokens long) plus a
    short random tail."""
    return st.builds(
        lambda base, cut, tail: (base * (max_len // 40 + 1))[:cut] + tail,
        st.sampled_from(bases),
        st.integers(0, max_len),
        st.lists(st.integers(0, 5), max_size=max_len // 4),
    )


class EvictionOrderCheck:
    """Tree listener: every evicted leaf had the smallest policy key of all the evictable
    leaves at that moment, found by brute force (its parent, which only now became a leaf,
    excepted)."""

    def __init__(self, cache: RadixCache, policy: str) -> None:
        self.cache, self.key = cache, POLICIES[policy].key
        self.evicted = 0

    def on_insert(self, node: object) -> None:
        pass

    def on_split(self, upper: object, lower: object) -> None:
        pass

    def on_evict(self, node) -> None:  # type: ignore[no-untyped-def]
        c = self.cache
        others = [n for n in c._nodes() if c._evictable_leaf(n) and n is not node.parent]
        assert all(self.key(node) <= self.key(n) for n in others), "evicted out of order"
        self.evicted += 1


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    max_len = 40
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        p = self.page_size
        self.cache = RadixCache(
            CacheConfig(page_size=p, max_total_tokens=4096, radix_eviction_policy=self.policy)
        )
        self.cache.listeners.append(EvictionOrderCheck(self.cache, self.policy))
        self.alloc = SlotAllocator(16 * self.max_len * p, p)
        # every cached page-aligned prefix -> the slots of its last page
        self.ref: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.running: list[tuple[list[int], list[int], int, object]] = []

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def ref_match(self, tokens: list[int]) -> list[int]:
        k = 0
        while k + self.page_size <= len(tokens) and tuple(tokens[: k + self.page_size]) in self.ref:
            k += self.page_size
        p = self.page_size
        return [s for i in range(p, k + 1, p) for s in self.ref[tuple(tokens[:i])]]

    @rule(tokens=prompts(max_len))
    def match(self, tokens: list[int]) -> None:
        result = self.cache.match_prefix(tokens)
        assert list(result.slots) == self.ref_match(tokens)
        assert result.length == len(result.slots)

    @rule(tokens=prompts(max_len))
    def start_request(self, tokens: list[int]) -> None:
        result = self.cache.match_prefix(tokens)
        need = len(tokens) - result.length
        if self.alloc.pages_for(need) * self.page_size > self.alloc.available():
            self.alloc.free(self.cache.evict(need))
            self.sync_ref_after_evict()
        if self.alloc.pages_for(need) * self.page_size > self.alloc.available():
            return
        self.cache.lock(result.last_node)
        slots = list(result.slots + self.alloc.alloc(need))
        self.running.append((tokens, slots, result.length, result.last_node))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), priority=st.integers(0, 3))
    def finish_request(self, data: st.DataObject, priority: int) -> None:
        i = data.draw(st.integers(0, len(self.running) - 1))
        tokens, slots, matched, node = self.running.pop(i)
        end = self.aligned(len(tokens))
        already = self.cache.insert(tokens, slots, priority=priority)
        assert matched <= already <= end
        p = self.page_size
        for k in range(already + p, end + 1, p):
            self.ref.setdefault(tuple(tokens[:k]), tuple(slots[k - p : k]))
        dupes = slots[matched:already] + slots[end:]
        dupes = [s for s in dupes if s not in self.cached_slots()] if already > matched else dupes
        if dupes:
            self.alloc.free(dupes)
        self.cache.unlock(node)

    def cached_slots(self) -> set[int]:
        return {s for page in self.ref.values() for s in page}

    @rule(n=st.integers(0, 200))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_size()
        freed = self.cache.evict(n)
        assert len(freed) >= min(n, before)
        assert not set(freed) & self.locked_slots(), "evicted a locked prefix"
        self.alloc.free(freed)
        self.sync_ref_after_evict(set(freed))

    def locked_slots(self) -> set[int]:
        return {s for _, slots, matched, _ in self.running for s in slots[:matched]}

    def sync_ref_after_evict(self, freed: set[int] | None = None) -> None:
        if freed is None:
            freed = self.cached_slots() - {s for s in self.cache_values()}
        self.ref = {k: v for k, v in self.ref.items() if v[0] not in freed}

    def cache_values(self) -> list[int]:
        return [s for node in self.cache._nodes() for s in node.value]

    @invariant()
    def accounting(self) -> None:
        self.cache.check_integrity()
        held = sum(
            self.alloc.pages_for(len(slots) - matched) * self.page_size
            for _, slots, matched, _ in self.running
        )
        total = self.cache.evictable_size() + self.cache.protected_size()
        assert total == len(self.ref) * self.page_size
        assert self.alloc.available() + total + held == self.alloc.total
        protected = {s for s in self.locked_slots()}
        assert self.cache.protected_size() == len(protected)


class RadixMachinePaged(RadixMachine):
    page_size = 16
    max_len = 80


_POLICY_SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None)


def _policy_case(policy: str, base: type[RadixMachine] = RadixMachine) -> type:
    """The state machine's test case under another eviction policy."""
    case = type(f"{base.__name__}_{policy}", (base,), {"policy": policy}).TestCase
    case.settings = _POLICY_SETTINGS
    return case


TestRadixPage1 = RadixMachine.TestCase
TestRadixPage1.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestRadixPage16 = RadixMachinePaged.TestCase
TestRadixPage16.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestRadixLFU = _policy_case("lfu")
TestRadixFIFO = _policy_case("fifo")
TestRadixMRU = _policy_case("mru")
TestRadixFILO = _policy_case("filo")
TestRadixPriority = _policy_case("priority")
TestRadixHitBenefit = _policy_case("hit-benefit")
TestRadixPage16Benefit = _policy_case("hit-benefit", RadixMachinePaged)


def test_parent_becomes_evictable_leaf() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [0, 1, 3])  # splits after [1, 2]
    assert sorted(cache.evict(10)) == [0, 1, 2, 3]
    assert cache.total_size() == 0
    cache.check_integrity()


def test_locked_node_survives_eviction() -> None:
    cache = RadixCache()
    cache.insert([5, 6, 7], [0, 1, 2])
    hit = cache.match_prefix([5, 6, 9])
    cache.lock(hit.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (2, 1)
    assert list(cache.evict(3)) == [2]
    assert list(cache.match_prefix([5, 6]).slots) == [0, 1]
    cache.unlock(hit.last_node)
    assert list(cache.evict(3)) == [0, 1]
    with pytest.raises(RuntimeError):
        cache.unlock(hit.last_node)


def test_namespaces_never_share() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2], namespace="lora-a")
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([1, 2, 3], namespace="lora-b").length == 0
    assert list(cache.match_prefix([1, 2, 3], namespace="lora-a").slots) == [0, 1, 2]
    assert cache.insert([1, 2, 3], [7, 8, 9], namespace="lora-b") == 0
    cache.check_integrity()


def test_paged_match_and_insert_are_page_truncated() -> None:
    cache = RadixCache(CacheConfig(page_size=4))
    toks = list(range(10))
    assert cache.insert(toks, list(range(100, 110))) == 0
    assert cache.total_size() == 8
    assert cache.match_prefix(toks).length == 8
    assert cache.match_prefix(toks[:6] + [99, 99]).length == 4  # diverges inside page 2
    cache.check_integrity()


def test_reset_returns_slots_and_refuses_when_locked() -> None:
    cache = RadixCache()
    cache.insert([1, 2], [3, 4])
    hit = cache.match_prefix([1, 2])
    cache.lock(hit.last_node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(hit.last_node)
    assert sorted(cache.reset()) == [3, 4]
    assert cache.total_size() == 0


def test_fresh_int_objects_and_other_sequence_types_match() -> None:
    """Callers pass newly tokenized ids: equal values, never the inserted int objects."""
    cache = RadixCache()
    toks = [1000 + i for i in range(50)]
    cache.insert(toks, list(range(50)))
    fresh = array("q", toks).tolist()
    assert all(a is not b for a, b in zip(toks, fresh))
    for query in (fresh, tuple(fresh), array("Q", fresh), range(1000, 1050)):
        assert list(cache.match_prefix(query).slots) == list(range(50))
    assert cache.match_prefix(fresh[:30] + [7]).length == 30  # splits the node after 30
    assert cache.insert(tuple(fresh[:30]) + (5, 6), range(100, 132)) == 30
    assert list(cache.match_prefix(fresh[:30] + [5, 6]).slots) == [*range(30), 130, 131]
    cache.check_integrity()


def test_token_ids_are_unsigned_64_bit() -> None:
    """Keys start 32-bit; a larger id widens every key once, and matches go on as before."""
    cache = RadixCache(CacheConfig(page_size=2))
    assert cache.insert([1, 2, 3, 4], [0, 1, 2, 3]) == 0
    cache.match_prefix([1, 2, 9, 9])  # a split before the widening
    big = [1, 2, 2**40, 2**64 - 1]
    assert cache.insert(big, [0, 1, 4, 5]) == 2
    cache.check_integrity()
    assert list(cache.match_prefix(array("q", [1, 2, 3, 4]).tolist()).slots) == [0, 1, 2, 3]
    assert list(cache.match_prefix([1, 2, 2**40, 2**64 - 1, 7]).slots) == [0, 1, 4, 5]
    for bad in (-1, 2**64, 1.5):
        with pytest.raises(ValueError, match="token ids"):
            cache.insert([1, 2, bad, 0], [5, 6, 7, 8])
        with pytest.raises(ValueError, match="token ids"):
            cache.match_prefix([1, 2, bad, 0])
    cache.check_integrity()
    assert sorted(cache.reset()) == [0, 1, 2, 3, 4, 5]
    assert cache.insert([7, 8], [0, 1]) == 0
    cache.check_integrity()


def test_match_slots_survive_later_splits_and_evictions() -> None:
    """A result's slots are those of the prefix when it was matched, read later or not."""
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    hit = cache.match_prefix([1, 2, 3, 4, 5, 6])
    early = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert list(early.slots) == [10, 11, 12, 13, 14, 15]
    cache.match_prefix([1, 2, 9])  # splits the node after [1, 2]
    cache.insert([1, 2, 3, 4, 7], [10, 11, 12, 13, 20])  # and after [1, 2, 3, 4]
    assert hit.slots == early.slots
    kept = cache.match_prefix([1, 2, 3, 4, 7])
    unread = cache.match_prefix([1, 2, 3, 4, 5, 6])  # its slots are first read after eviction
    cache.lock(kept.last_node)
    assert sorted(cache.evict(100)) == [14, 15]
    assert sum(len(n.value) for n in cache._nodes()) == 5  # the evicted leaf kept its own
    assert list(unread.slots) == [10, 11, 12, 13, 14, 15] and unread.length == 6
    assert hit.slots == early.slots and hit.length == 6
    assert list(kept.slots) == [10, 11, 12, 13, 20]
    assert list(cache.match_prefix([1, 2, 3, 4, 7, 8]).slots) == [10, 11, 12, 13, 20]
    cache.check_integrity()
    cache.unlock(kept.last_node)
    unread = cache.match_prefix([1, 2, 3, 4, 7])
    assert sorted(cache.evict(100)) == [10, 11, 12, 13, 20]
    assert cache.total_size() == 0
    assert list(unread.slots) == [10, 11, 12, 13, 20]
    assert list(kept.slots) == [10, 11, 12, 13, 20] and hit.slots == early.slots
    cache.check_integrity()


def test_ids_in_an_array_of_the_key_type_match_like_a_list() -> None:
    cache = RadixCache()
    seq = [300 + i for i in range(50)]
    cache.insert(array(cache.key_typecode, seq[:30]), list(range(30)))
    hit = cache.match_prefix(array(cache.key_typecode, seq))
    assert hit.length == 30 and list(hit.slots) == list(range(30))
    assert cache.insert(array(cache.key_typecode, seq), list(range(100, 150))) == 30
    assert list(cache.match_prefix(seq).slots) == list(range(30)) + list(range(130, 150))
    assert cache.match_prefix(array("q", seq)).length == 50  # another typecode: converted
    cache.check_integrity()


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_and_match_leaves_the_tree_as_insert_then_match(policy: str, page_size: int) -> None:
    """The scheduler caches a request with one walk: every later eviction and match is the
    same as after an insert and a match of the same tokens."""
    rng = random.Random(f"{policy}{page_size}")
    config = CacheConfig(page_size=page_size, radix_eviction_policy=policy)
    two, one = RadixCache(config), RadixCache(config)
    for i in range(60):
        base = rng.choice([[1, 2, 3, 4] * 3, [5, 6, 7, 8] * 2, []])
        seq = base + [rng.randrange(20) for _ in range(rng.randrange(1, 12))]
        slots = list(range(1000 * i, 1000 * i + len(seq)))
        two.insert(seq, slots)
        want = two.match_prefix(seq)
        got = one.insert_and_match(seq, slots)
        assert (got.length, list(got.slots)) == (want.length, list(want.slots))
        if rng.random() < 0.3:
            n = rng.randrange(1, 10)
            assert list(one.evict(n)) == list(two.evict(n))
    while one.total_size():
        assert list(one.evict(1)) == list(two.evict(1))
    assert two.total_size() == 0
    one.check_integrity()
