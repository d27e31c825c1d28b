"""Tree eviction off the dispatch path (issue 15): the sliced eviction reaches the same cap as
the whole-tree one, in slices of bounded work, while inserts and other evictions interleave;
the cache_aware policy in the router defers it instead of walking the tree inside a dispatch."""

from __future__ import annotations

import random
from array import array

from radixserve.router.policies.base import RequestView, WorkerView
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.registry import create_policy
from radixserve.router.policies.tree import MultiTenantTree


def key_of(*unit_values: int) -> bytes:
    return array("Q", unit_values).tobytes()


def filled(seed: int, n: int = 600) -> MultiTenantTree:
    rng, tree = random.Random(seed), MultiTenantTree(node_units=4)
    for i in range(n):
        prefix = rng.randrange(30)
        key = key_of(prefix, *(rng.randrange(1000) for _ in range(rng.randrange(1, 6))))
        tree.insert(key, f"t{rng.randrange(3)}", now=float(i))
    return tree


def test_sliced_eviction_evicts_as_much_as_the_whole_tree_walk() -> None:
    whole, sliced = filled(1), filled(1)
    evicted = whole.evict_tenant_by_cost(400)
    progress = list(sliced.evict_in_slices(400, nodes_per_slice=50))
    assert len(progress) > 5  # it really came in slices
    sliced.check_integrity()
    for t in ("t0", "t1", "t2"):
        assert sliced.cost(t) <= 400 and whole.cost(t) <= 400
    assert evicted > 0 and abs(progress[-1] - evicted) <= 0.05 * evicted  # about as much


def test_a_tenant_far_over_the_cap_gets_there_in_a_few_passes() -> None:
    tree = filled(2)
    passes = 0
    while max(tree.cost(t) for t in ("t0", "t1", "t2")) > 100:
        list(tree.evict_in_slices(100, nodes_per_slice=50))  # one pass drops only the leaves
        passes += 1
        assert passes <= 5
    tree.check_integrity()


def test_inserts_and_removals_between_slices_keep_the_tree_sound() -> None:
    rng = random.Random(7)
    for seed in range(20):
        tree = filled(seed)
        for i, _ in enumerate(tree.evict_in_slices(300, nodes_per_slice=20)):
            op = rng.random()
            if op < 0.6:  # a dispatch lands mid-eviction, often on a node about to go
                key = key_of(rng.randrange(30), *(rng.randrange(1000) for _ in range(3)))
                tree.insert(key, f"t{rng.randrange(3)}", now=1000.0 + i)
            elif op < 0.65:
                tree.remove_tenant(f"t{rng.randrange(3)}")
            tree.check_integrity()
        tree.check_integrity()


def test_the_router_defers_eviction_to_slices() -> None:
    config = CachePolicyConfig(max_tree_size=2000, eviction_interval_secs=60)
    policy = create_policy("cache_aware", config)
    policy.defer_eviction = True  # as the router sets it
    workers = [WorkerView("w1"), WorkerView("w2")]
    for i in range(200):
        view = RequestView.from_prompt(text=f"{i:08d}" * 40)
        policy.on_dispatch(workers[policy.select(workers, view, i)].id, view, float(i))
    assert policy.evict_due and max(policy.tree.cost(w.id) for w in workers) > 2000
    for _ in policy.eviction_slices():
        pass
    assert not policy.evict_due and all(policy.tree.cost(w.id) <= 2000 for w in workers)
    inline = create_policy("cache_aware", config)  # the simulator's: evicts in the dispatch
    for i in range(200):
        view = RequestView.from_prompt(text=f"{i:08d}" * 40)
        inline.on_dispatch(workers[inline.select(workers, view, i)].id, view, float(i))
    assert not inline.evict_due and all(inline.tree.cost(w.id) <= 2000 for w in workers)
