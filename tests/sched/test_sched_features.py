"""One test per scheduler feature of issue 3 that fails if the feature breaks: the policy
registry, in-batch prefix dedupe, the PrefillAdder's budgets, retraction order, caching."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from radixserve.config import CacheConfig, SchedulerConfig, choices_of
from radixserve.sched.keyed_heap import KeyedHeap
from radixserve.sched.policy import POLICIES
from radixserve.sched.request import Req
from radixserve.sched.scheduler import Scheduler
from test_sched_support import Clock, KVRunner, drive, make_req, reference, tokens


def make(pool: int = 8192, page: int = 1, **kw: object) -> tuple[Scheduler, KVRunner, Clock]:
    clock = Clock()
    cfg = SchedulerConfig(**kw)  # type: ignore[arg-type]
    sched = Scheduler(cfg, CacheConfig(max_total_tokens=pool, page_size=page), clock=clock)
    return sched, KVRunner(pool), clock


def one_step(sched: Scheduler, runner: KVRunner) -> list[str]:
    """Run one step; returns the ids of its prefill entries."""
    batch = sched.step()
    assert batch is not None
    sched.on_output(batch, runner.run(batch))
    sched.check_integrity()
    return [e.rid for e in batch.entries if e.is_prefill]


def warm(sched: Scheduler, runner: KVRunner, *prompts: list[int]) -> None:
    """Cache ``prompts`` (each plus one token) by running them to the end."""
    for i, p in enumerate(prompts):
        sched.add_request(make_req(f"warm{i}", [*p, 1], 1))
    drive(sched, runner)


def admission_order(sched: Scheduler, runner: KVRunner, reqs: list[Req]) -> list[str]:
    """Queue ``reqs`` at once and run them (max_running_requests=1: one at a time)."""
    clock = sched.clock
    assert isinstance(clock, Clock)
    for r in reqs:
        sched.add_request(r)
    drive(sched, runner, clock)
    for r in reqs:
        assert r.output_ids == reference(r.input_ids, r.sampling.max_new_tokens)
    return [r.rid for r in sorted(reqs, key=lambda r: r.first_scheduled_time)]  # type: ignore[arg-type, return-value]


# -- policies ---------------------------------------------------------------------------------
def test_registry_holds_every_policy_of_the_cli() -> None:
    field = next(f for f in dataclasses.fields(SchedulerConfig) if f.name == "schedule_policy")
    names = set(choices_of(field.metadata["choices"]))  # what --schedule-policy offers
    assert names == set(POLICIES)  # the CLI offers exactly what is registered
    assert {"fcfs", "lpm", "dfs-weight", "lof", "random", "routing-key", "priority"} <= names
    rng = random.Random(3)
    for name in names:  # each one builds and runs requests to the right outputs
        sched, runner, _ = make(schedule_policy=name)
        reqs = [make_req(f"r{i}", tokens(rng, 20), 4) for i in range(3)]
        for r in reqs:
            sched.add_request(r)
        drive(sched, runner)
        assert all(r.output_ids == reference(r.input_ids, 4) for r in reqs), name


def test_fcfs_and_lpm_order() -> None:
    rng = random.Random(1)
    cached = tokens(rng, 300)
    orders = {}
    for policy in ("fcfs", "lpm"):
        sched, runner, _ = make(schedule_policy=policy, max_running_requests=1)
        warm(sched, runner, cached)
        reqs = [
            make_req("cold", tokens(rng, 300)),
            make_req("short", cached[:100] + tokens(rng, 200)),
            make_req("long", cached + tokens(rng, 5)),
        ]
        orders[policy] = admission_order(sched, runner, reqs)
    assert orders == {"fcfs": ["cold", "short", "long"], "lpm": ["long", "short", "cold"]}


def test_lof_runs_the_longest_output_first() -> None:
    sched, runner, _ = make(schedule_policy="lof", max_running_requests=1)
    rng = random.Random(2)
    reqs = [make_req(f"n{n}", tokens(rng, 20), n) for n in (3, 9, 1, 5)]
    assert admission_order(sched, runner, reqs) == ["n9", "n5", "n3", "n1"]


def test_random_is_seeded_and_not_arrival_order() -> None:
    orders = []
    for seed in (5, 5, 6):
        sched, runner, _ = make(schedule_policy="random", max_running_requests=1, seed=seed)
        rng = random.Random(3)
        orders.append(
            admission_order(sched, runner, [make_req(f"r{i}", tokens(rng, 9), 2) for i in range(8)])
        )
    assert orders[0] == orders[1] != orders[2]
    assert sorted(orders[0]) == sorted(orders[2]) and orders[0] != sorted(orders[0])


def test_routing_key_prefers_keys_of_the_running_batch() -> None:
    sched, runner, _ = make(schedule_policy="routing-key", max_running_requests=2)
    rng = random.Random(4)
    sched.add_request(make_req("b-running", tokens(rng, 10), 50, routing_key="b"))
    one_step(sched, runner)
    reqs = [
        make_req("a1", tokens(rng, 10), 2, routing_key="a"),
        make_req("none", tokens(rng, 10), 2),
        make_req("b1", tokens(rng, 10), 2, routing_key="b"),
    ]
    for r in reqs:
        sched.add_request(r)
    assert one_step(sched, runner) == ["b1"]  # one slot left: key b runs, a and none wait


def test_dfs_weight_runs_the_heaviest_subtree_first_and_together() -> None:
    rng = random.Random(5)
    x, y = tokens(rng, 200), tokens(rng, 200)
    sched, runner, _ = make(schedule_policy="dfs-weight")
    warm(sched, runner, x, y)
    reqs = [make_req("y0", y + tokens(rng, 5))]
    reqs += [make_req(f"x{i}", x + tokens(rng, 5)) for i in range(3)]
    reqs += [make_req("y1", y + tokens(rng, 5)), make_req("cold", tokens(rng, 205))]
    for r in reqs:
        sched.add_request(r)
    assert one_step(sched, runner) == ["x0", "x1", "x2", "y0", "y1", "cold"]


def test_dfs_weight_follows_a_split_under_waiting_requests() -> None:
    """A request that arrives later and splits the node others wait on moves their subtree
    weight onto the new upper node; the integrity check recounts every weight."""
    rng = random.Random(6)
    x = tokens(rng, 200)
    sched, runner, _ = make(schedule_policy="dfs-weight", max_running_requests=1)
    warm(sched, runner, x)
    sched.add_request(make_req("hold", tokens(rng, 30), 20))
    one_step(sched, runner)  # "hold" runs; everything below waits behind it
    waiting = [make_req(f"x{i}", x + tokens(rng, 5)) for i in range(2)]
    for r in waiting:
        sched.add_request(r)
    node = waiting[0].match_node
    sched.add_request(make_req("half", x[:100] + tokens(rng, 5)))  # its match splits x's node
    assert waiting[0].match_node is node and node.parent.key.tolist() == x[:100]
    sched.check_integrity()
    drive(sched, runner)
    for r in waiting:
        assert r.output_ids == reference(r.input_ids, r.sampling.max_new_tokens)


@pytest.mark.parametrize("how", ["flag", "policy"])
def test_priority_runs_higher_priority_first(how: str) -> None:
    kw = {"enable_priority_scheduling": True} if how == "flag" else {"schedule_policy": "priority"}
    sched, runner, _ = make(max_running_requests=1, **kw)
    rng = random.Random(6)
    reqs = [make_req(f"p{p}", tokens(rng, 10), 2, priority=p) for p in (0, 2, 1, 2)]
    reqs[3].rid = "p2-later"
    assert admission_order(sched, runner, reqs) == ["p2", "p2-later", "p1", "p0"]


def test_no_preemption_without_a_threshold_or_within_it() -> None:
    for threshold in (None, 5):
        sched, runner, _ = make(
            enable_priority_scheduling=True,
            priority_preemption_threshold=threshold,
            max_running_requests=1,
        )
        rng = random.Random(7)
        sched.add_request(make_req("low", tokens(rng, 10), 20, priority=0))
        one_step(sched, runner)
        sched.add_request(make_req("high", tokens(rng, 10), 2, priority=5))
        one_step(sched, runner)
        assert sched.stats().num_retracted == 0 and sched.get("high").state.value == "waiting"  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["flag", "policy"])
def test_preemption_follows_the_one_priority_rule(how: str) -> None:
    """--schedule-policy priority orders by priority as the flag does, so a threshold preempts
    under either (the scheduler used to read the flag alone and ignore the threshold)."""
    from radixserve.sched.policy import orders_by_priority

    kw = {"enable_priority_scheduling": True} if how == "flag" else {"schedule_policy": "priority"}
    assert orders_by_priority(kw.get("schedule_policy", "lpm"), how == "flag")
    sched, runner, _ = make(priority_preemption_threshold=1, max_running_requests=1, **kw)
    rng = random.Random(7)
    sched.add_request(make_req("low", tokens(rng, 10), 20, priority=0))
    one_step(sched, runner)
    sched.add_request(make_req("high", tokens(rng, 10), 2, priority=5))
    one_step(sched, runner)
    assert sched.stats().num_retracted == 1 and sched.get("high").state.value != "waiting"  # type: ignore[union-attr]


def test_bounded_wait_zero_is_arrival_order() -> None:
    rng = random.Random(8)
    cached = tokens(rng, 300)
    sched, runner, clock = make(schedule_policy="lpm", max_wait_ms=0, max_running_requests=1)
    warm(sched, runner, cached)
    clock.t = 1.0
    reqs = [make_req("cold", tokens(rng, 300)), make_req("hot", cached + tokens(rng, 5))]
    assert admission_order(sched, runner, reqs) == ["cold", "hot"]


# -- in-batch prefix dedupe -------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_in_batch_dedupe_prefills_a_shared_uncached_prefix_once(policy: str) -> None:
    rng = random.Random(9)
    shared = tokens(rng, 200)
    sched, runner, _ = make(schedule_policy=policy)
    for i in range(4):
        sched.add_request(make_req(f"s{i}", shared + tokens(rng, 10), 4))
    sched.add_request(make_req("other", tokens(rng, 210), 4))
    first = one_step(sched, runner)
    if policy == "fcfs":  # not cache-aware: everything at once, the prefix computed 4 times
        assert len(first) == 5 and runner.prefill_tokens == 5 * 210
        return
    assert sorted(first) == ["other", "s0"]  # one of the sharing requests, and the rest
    assert sorted(one_step(sched, runner)) == ["s1", "s2", "s3"]  # now they hit the cache
    assert runner.prefill_tokens == 2 * 210 + 3 * 10
    assert [sched.get(f"s{i}").cached_tokens for i in range(1, 4)] == [200] * 3  # type: ignore[union-attr]


def test_in_batch_dedupe_can_be_turned_off() -> None:
    rng = random.Random(10)
    shared = tokens(rng, 200)
    sched, runner, _ = make(in_batch_prefix_threshold=0)
    for i in range(3):
        sched.add_request(make_req(f"s{i}", shared + tokens(rng, 10), 4))
    assert len(one_step(sched, runner)) == 3


# -- PrefillAdder budgets ---------------------------------------------------------------------
def test_max_prefill_tokens_counts_only_uncached_tokens() -> None:
    rng = random.Random(11)
    cached = tokens(rng, 1000)
    sched, runner, _ = make(max_prefill_tokens=200, chunked_prefill_size=-1)
    warm(sched, runner, cached)
    for i in range(6):
        sched.add_request(make_req(f"h{i}", cached + tokens(rng, 50), 4))
    assert len(one_step(sched, runner)) == 4  # 4 x 50 uncached tokens; 4,000 cached are free
    # a prompt longer than the budget still runs (alone), or it never could
    sched.add_request(make_req("big", tokens(rng, 500), 4))
    sched.add_request(make_req("small", tokens(rng, 20), 4))
    drive(sched, runner)
    assert sched.get("big") is None and sched.stats().num_finished == 9


def test_max_running_requests_is_never_exceeded() -> None:
    sched, runner, _ = make(max_running_requests=3)
    rng = random.Random(12)
    for i in range(10):
        sched.add_request(make_req(f"r{i}", tokens(rng, 20), 5 + i))
    seen = []
    drive(sched, runner, on_step=lambda s: seen.append(s.num_running))
    assert max(seen) == 3


def _exact_reserve(**kw: object) -> dict[str, object]:
    return dict(new_token_ratio=1.0, min_new_token_ratio=1.0, chunked_prefill_size=-1, **kw)


def test_kv_budget_reserves_what_running_requests_may_still_decode() -> None:
    rng = random.Random(13)
    sched, runner, _ = make(pool=1000, **_exact_reserve())
    sched.add_request(make_req("a", tokens(rng, 100), 400))
    one_step(sched, runner)  # a: 100 slots held, 399 new tokens reserved
    spare = sched.kv.room() - 399
    sched.add_request(make_req("too-big", tokens(rng, spare - 190), 200))  # 10 too many
    sched.add_request(make_req("fits", tokens(rng, spare - 210), 200))  # 10 to spare
    batch = sched.step()
    assert batch is not None and [e.rid for e in batch.entries if e.is_prefill] == []
    sched.on_output(batch, runner.run(batch))
    sched.abort("too-big")
    assert one_step(sched, runner) == ["fits"]


def test_kv_budget_caps_the_reserve_at_4096_new_tokens() -> None:
    rng = random.Random(14)
    sched, runner, _ = make(pool=10000, **_exact_reserve())
    sched.add_request(make_req("long", tokens(rng, 100), 9000))
    one_step(sched, runner)  # reserves min(8999, 4096) tokens, not 8999
    sched.add_request(make_req("next", tokens(rng, 4000), 500))  # needs 4,500 of ~5,800 left
    assert one_step(sched, runner) == ["next"]


def test_a_cached_prefix_costs_the_kv_budget_nothing_and_is_locked_while_running() -> None:
    rng = random.Random(15)
    shared = tokens(rng, 400)
    sched, runner, _ = make(pool=1000, **_exact_reserve())
    sched.add_request(make_req("a", shared + tokens(rng, 10), 200))
    one_step(sched, runner)  # a holds 410 slots (the shared 400 locked in the tree), reserves 199
    assert sched.kv.room() - 199 == 391
    # both need 550 prompt tokens + 200 new ones; b's first 400 are cached, so it needs 350
    sched.add_request(make_req("c", tokens(rng, 550), 200))
    sched.add_request(make_req("b", shared + tokens(rng, 150), 200))
    assert one_step(sched, runner) == ["b"]
    assert sched.get("b").cached_tokens == 400  # type: ignore[union-attr]
    sched.abort("a")
    assert sched.cache.protected_size() >= 400  # still locked, by b: eviction cannot take it
    sched.abort("c")
    drive(sched, runner)
    assert sched.cache.protected_size() == 0


def test_new_token_ratio_decays_with_decoding_and_resets_on_retraction() -> None:
    sched, runner, _ = make(
        pool=400, new_token_ratio=0.5, min_new_token_ratio=0.01, new_token_ratio_decay=0.01
    )
    rng = random.Random(16)
    for i in range(6):
        sched.add_request(make_req(f"r{i}", tokens(rng, 30), 150))
    ratios = []
    drive(
        sched,
        runner,
        on_step=lambda s: ratios.append((s.stats().new_token_ratio, s.stats().num_retracted)),
    )
    before = [r for r, n in ratios if n == 0]
    assert before[-1] < before[0]  # decays while nothing is retracted
    first = next(i for i, (_, n) in enumerate(ratios) if n > 0)
    assert ratios[first][0] >= 0.5  # raised back up by the retraction


# -- retraction and caching -------------------------------------------------------------------
def test_retraction_takes_the_request_with_fewest_generated_tokens_first() -> None:
    rng = random.Random(17)
    sched, runner, _ = make(pool=600, new_token_ratio=0.01, min_new_token_ratio=0.01)
    reqs = [make_req(f"r{i}", tokens(rng, 50), 250) for i in range(3)]
    for r in reqs:  # admitted 10 steps apart: r0 has generated the most
        sched.add_request(r)
        for _ in range(10):
            one_step(sched, runner)
    while sched.stats().num_retracted == 0:
        one_step(sched, runner)
    assert [r.num_retractions for r in reqs] == [0, 0, 1]
    drive(sched, runner)
    for r in reqs:
        assert r.output_ids == reference(r.input_ids, 250)


@pytest.mark.parametrize("page", [1, 4])
def test_a_finished_request_is_cached_whole_but_its_last_token(page: int) -> None:
    rng = random.Random(18)
    sched, runner, _ = make(page=page)
    req = make_req("r", tokens(rng, 41), 10)
    sched.add_request(req)
    drive(sched, runner)
    computed = [*req.input_ids, *req.output_ids[:-1]]  # the last token's KV is never computed
    whole = len(computed) - len(computed) % page
    assert sched.cache.match_prefix(computed + req.output_ids[-1:]).length == whole
    assert sched.cache.total_size() == whole


def test_a_chunked_prompt_is_cached_after_each_chunk() -> None:
    rng = random.Random(19)
    sched, runner, _ = make(chunked_prefill_size=64)
    req = make_req("r", tokens(rng, 200), 4)
    sched.add_request(req)
    for n in (64, 128, 192):
        one_step(sched, runner)
        assert sched.cache.match_prefix(req.input_ids).length == n
        assert sched.cache.protected_size() == n  # locked by the request that is filling it
    twin = make_req("twin", [*req.input_ids, 5], 4)  # arrives mid-prefill: reuses the chunks
    sched.add_request(twin)
    drive(sched, runner)
    assert twin.cached_tokens == 192


def test_keyed_heap_drops_requests_that_leave_from_the_front() -> None:
    # admitted requests leave from the front of the order; if their stale entries stayed at the
    # top, every pass would walk all of them until the next compaction (O(queue) per pass)
    heap = KeyedHeap()
    reqs = [make_req(f"r{i}", [1]) for i in range(3000)]
    for i, r in enumerate(reqs[:1000]):
        heap.put(r, (i,))
    for start in range(0, 2000, 20):
        front = list(itertools.islice(heap, 20))
        for r in front:
            heap.discard(r)
        for i in range(1000 + start, 1020 + start):
            heap.put(reqs[i], (i,))
        assert len(heap._heap) == len(heap) == 1000
    assert [r.rid for r in itertools.islice(heap, 3)] == ["r2000", "r2001", "r2002"]


def test_a_tree_change_rematches_only_the_requests_it_can_extend() -> None:
    rng = random.Random(20)
    shared = tokens(rng, 200)
    sched, runner, clock = make(schedule_policy="lpm", max_running_requests=1)
    sched.add_request(make_req("first", [*shared, 5], 2))
    followers = [make_req(f"f{i}", shared + tokens(rng, 10), 2) for i in range(3)]
    firsts = [t for t in range(200) if t != shared[0]]  # so no two cold prompts share a prefix
    cold = [make_req(f"c{i}", [firsts[i], *tokens(rng, 200)], 2) for i in range(100)]
    for r in followers + cold:
        sched.add_request(r)
    before = sched.index.refreshed
    drive(sched, runner, clock)  # caches "first", then runs the rest
    assert sched.index.refreshed - before == 3  # the followers, never the 100 cold ones
    assert [r.cached_tokens for r in followers] == [200] * 3
    assert max(r.first_scheduled_time for r in followers) < min(  # type: ignore[type-var]
        r.first_scheduled_time
        for r in cold  # type: ignore[misc]
    )
