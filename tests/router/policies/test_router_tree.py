"""Tests of the router's multi-tenant prefix tree and its key encoders.
A property-based test drives the tree against a naive per-tenant set of prefixes."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.router.policies.tree import MultiTenantTree
from radixserve.router.policies.tree_keys import UNIT, ids_key, namespace, text_key, units


def key_of(*unit_values: int) -> bytes:
    return array("Q", unit_values).tobytes()


def test_match_longest_prefix_and_its_tenants() -> None:
    tree = MultiTenantTree()
    tree.insert(key_of(1, 2, 3, 4), "a", now=1.0)
    tree.insert(key_of(1, 2, 9), "b", now=2.0)
    assert tree.prefix_match(key_of(1, 2, 3, 4, 5)) == (4, ["a"])
    assert tree.prefix_match(key_of(1, 2, 7)) == (2, ["a", "b"])
    assert tree.prefix_match(key_of(8)) == (0, [])
    assert tree.prefix_match_tenant(key_of(1, 2, 3), "b") == 2
    assert tree.tenant_matches(key_of(1, 2, 3)) == {"a": (3, 1, 1.0), "b": (2, 1, 2.0)}
    assert (tree.size("a"), tree.size("b")) == (4, 3)
    tree.check_integrity()


def test_insert_reports_what_the_tenant_already_held() -> None:
    tree = MultiTenantTree()
    assert tree.insert(key_of(1, 2, 3), "a", now=1.0) == 0
    assert tree.insert(key_of(1, 2, 5), "a", now=2.0) == 2
    assert tree.insert(key_of(1, 2, 5), "b", now=3.0) == 0
    assert tree.insert(key_of(1, 2, 5, 6), "b", now=4.0) == 3


def test_namespaces_never_share_a_node() -> None:
    tree = MultiTenantTree()
    base, lora = namespace("text", "m"), namespace("text", "m", lora="sql")
    tree.insert(text_key("the same system prompt"), "a", now=1.0, ns=base)
    assert tree.prefix_match(text_key("the same system prompt"), ns=lora) == (0, [])
    assert tree.prefix_match_tenant(text_key("the same system prompt"), "a", ns=lora) == 0
    assert tree.prefix_match(text_key("the same system prompt"), ns=base)[0] == 3


def test_eviction_drops_least_recently_used_leaves_first() -> None:
    tree = MultiTenantTree()
    tree.insert(key_of(1, 2, 3), "a", now=1.0)
    tree.insert(key_of(4, 5, 6), "a", now=2.0)
    tree.insert(key_of(1, 2, 3), "b", now=3.0)
    assert tree.evict_tenant_by_cost(4) == 3
    assert tree.prefix_match_tenant(key_of(1, 2, 3), "a") == 0
    assert tree.prefix_match_tenant(key_of(4, 5, 6), "a") == 3
    assert tree.prefix_match(key_of(1, 2, 3)) == (3, ["b"])
    tree.check_integrity()


def test_node_units_make_eviction_bound_memory_not_only_key_bytes() -> None:
    tree = MultiTenantTree(node_units=10)
    for i in range(1, 9):  # 8 short keys under one shared unit: 1 + 8 nodes, 9 units
        tree.insert(key_of(7, i), "a", now=float(i))
    assert (tree.size("a"), tree.cost("a")) == (9, 9 + 90)
    tree.insert(key_of(7, 1, 5), "b", now=9.0)  # splits nothing new for a
    assert tree.evict_tenant_by_cost(50) == 5  # five oldest leaves: 45 units of cost each 11
    assert tree.cost("a") <= 50 and tree.prefix_match_tenant(key_of(7, 8), "a") == 2
    assert tree.prefix_match_tenant(key_of(7, 1), "a") == 1  # its oldest leaf went first
    tree.check_integrity()


def test_eviction_under_a_node_with_many_children() -> None:
    tree = MultiTenantTree()
    for i in range(20_000):  # one shared system prompt, 20,000 distinct continuations
        tree.insert(key_of(1, 2, i + 10), "a", now=float(i))
    assert tree.evict_tenant_by_cost(2 + 10_000) == 10_000  # children counted once, not rescanned
    assert tree.prefix_match_tenant(key_of(1, 2, 10), "a") == 2
    assert tree.prefix_match_tenant(key_of(1, 2, 20_009), "a") == 3
    tree.check_integrity()


def test_remove_tenant_forgets_it_and_prunes_nodes() -> None:
    tree = MultiTenantTree()
    tree.insert(key_of(1, 2), "a", now=1.0)
    tree.insert(key_of(1, 3), "b", now=2.0)
    tree.remove_tenant("a")
    assert tree.prefix_match(key_of(1, 2)) == (1, ["b"])
    assert "a" not in tree.sizes()
    tree.remove_tenant("b")
    assert tree.prefix_match(key_of(1, 3)) == (0, [])
    tree.check_integrity()


def test_text_key_packs_utf8_into_units_and_keeps_prefixes() -> None:
    assert len(text_key("abc")) == UNIT
    assert text_key("12345678abc").startswith(text_key("12345678"))
    assert units(text_key("é" * 8)) == 2
    hashed = text_key("x" * 40, block_chars=16)
    assert units(hashed) == 3 and hashed[:UNIT] == hashed[UNIT : 2 * UNIT]


def test_ids_key_packs_two_ids_per_unit_exactly() -> None:
    assert ids_key([1, 2, 3, 4]) == array("I", [1, 2, 3, 4]).tobytes()
    assert units(ids_key([1, 2, 3])) == 2
    assert ids_key([1, 2, 3]) != ids_key([1, 2, 3, 0])
    with pytest.raises(ValueError):
        ids_key([1, -2])


def test_keys_that_are_not_whole_units_are_rejected() -> None:
    with pytest.raises(ValueError):
        MultiTenantTree().insert(b"abc", "a", now=0.0)


NAMESPACES = [(), namespace("text", "other-model")]
TENANTS = ["a", "b", "c"]
keys = st.lists(st.integers(0, 2), max_size=6).map(tuple)


class TreeVersusNaive(RuleBasedStateMachine):
    """The naive model: per namespace and tenant, every held prefix and its last access."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = MultiTenantTree()
        self.held: dict[tuple, dict[tuple, float]] = {}
        self.now = 0.0

    def naive(self, ns: tuple, tenant: str) -> dict[tuple, float]:
        return self.held.setdefault((ns, tenant), {})

    def naive_match(self, key: tuple, ns: tuple, tenant: str) -> int:
        held = self.naive(ns, tenant)
        return max(n for n in range(len(key) + 1) if n == 0 or key[:n] in held)

    @rule(key=keys, tenant=st.sampled_from(TENANTS), ns=st.sampled_from(NAMESPACES))
    def insert(self, key: tuple, tenant: str, ns: tuple) -> None:
        self.now += 1.0
        before = self.naive_match(key, ns, tenant)
        assert self.tree.insert(key_of(*key), tenant, self.now, ns) == before
        held = self.naive(ns, tenant)
        for n in range(1, len(key) + 1):
            held[key[:n]] = self.now

    @rule(key=keys, ns=st.sampled_from(NAMESPACES))
    def match(self, key: tuple, ns: tuple) -> None:
        lengths = {t: self.naive_match(key, ns, t) for t in TENANTS}
        best = max(lengths.values())
        length, tenants = self.tree.prefix_match(key_of(*key), ns)
        assert length == best
        assert set(tenants) == ({t for t, n in lengths.items() if n == best} if best else set())
        found = self.tree.tenant_matches(key_of(*key), ns)
        assert {t: m[0] for t, m in found.items()} == {t: n for t, n in lengths.items() if n}
        for t, (n, _, stamp) in found.items():
            assert stamp == self.naive(ns, t)[key[:n]]
            assert self.tree.prefix_match_tenant(key_of(*key), t, ns) == n

    def holds(self, prefix: tuple, tenant: str, ns: tuple) -> bool:
        return self.tree.prefix_match_tenant(key_of(*prefix), tenant, ns) == len(prefix)

    @precondition(lambda self: self.held)
    @rule(max_size=st.integers(0, 8))
    def evict(self, max_size: int) -> None:
        before = {t: self.tree.size(t) for t in TENANTS}
        self.tree.evict_tenant_by_cost(max_size)
        for (ns, tenant), held in self.held.items():
            kept = {p: s for p, s in held.items() if self.holds(p, tenant, ns)}
            gone = set(held) - set(kept)
            assert not gone or before[tenant] > max_size
            if gone and kept:
                assert max(held[p] for p in gone) <= min(kept.values()), "not LRU"
            self.held[(ns, tenant)] = kept
        assert all(self.tree.size(t) <= max_size for t in TENANTS)

    @rule(tenant=st.sampled_from(TENANTS))
    def remove_tenant(self, tenant: str) -> None:
        self.tree.remove_tenant(tenant)
        for ns in NAMESPACES:
            self.held.pop((ns, tenant), None)

    @invariant()
    def sizes_are_exact(self) -> None:
        self.tree.check_integrity()
        for tenant in TENANTS:
            count = sum(len(h) for (_, t), h in self.held.items() if t == tenant)
            assert self.tree.size(tenant) == count


TreeVersusNaive.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_tree_matches_naive_reference = TreeVersusNaive.TestCase
