"""Tests of the router policies with in-memory workers on a virtual clock.
Covers each policy's basic choice and cache_aware's locality, balance and failure modes."""

from __future__ import annotations

import math
import random
import string
from collections import Counter, defaultdict
from collections.abc import Hashable

import pytest

from radixserve.cache.kv_event_types import namespace_string
from radixserve.router.policies.base import NoWorkerAvailable, RequestView, RouterPolicy, WorkerView
from radixserve.router.policies.cache_aware import CacheAwarePolicy
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.registry import POLICIES, create_policy
from radixserve.router.policies.tree_keys import ids_key, text_key
from radixserve.router.proxy.request_body import request_view

NO_EVICTION = CachePolicyConfig(eviction_interval_secs=0)


def views(*loads: int, down: tuple[int, ...] = ()) -> list[WorkerView]:
    return [WorkerView(f"w{i}", load, i not in down) for i, load in enumerate(loads)]


def prompt(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase + " ", k=n))


class Fleet:
    """In-memory workers: a dispatch adds one load, which leaves `service_steps` steps later."""

    def __init__(self, policy: RouterPolicy, workers: int, service_steps: int) -> None:
        self.policy, self.service_steps = policy, service_steps
        self.ids: list[Hashable] = [f"w{i}" for i in range(workers)]
        self.loads = [0] * workers
        self.sent = Counter[int]()
        self._due: dict[int, list[tuple[int, RequestView]]] = defaultdict(list)

    def route(self, request: RequestView, step: int) -> int:
        views = [WorkerView(wid, load) for wid, load in zip(self.ids, self.loads)]
        pick = self.policy.select(views, request, float(step))
        self.policy.on_dispatch(self.ids[pick], request, float(step))
        self.loads[pick] += 1
        self.sent[pick] += 1
        self._due[step + self.service_steps].append((pick, request))
        return pick

    def advance(self, step: int) -> None:
        for pick, request in self._due.pop(step, []):
            self.loads[pick] -= 1
            self.policy.on_complete(self.ids[pick], request, float(step))


def test_registry_builds_every_policy_and_rejects_unknown_names() -> None:
    assert set(POLICIES) >= {"round_robin", "random", "power_of_two", "least_load", "cache_aware"}
    for name in POLICIES:
        assert create_policy(name).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        create_policy("fastest")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_routes_only_to_healthy_workers(name: str) -> None:
    policy = create_policy(name, NO_EVICTION, seed=1)
    workers = views(0, 0, 0, down=(0, 2))
    for step in range(20):
        request = RequestView.from_prompt(f"request {step}")
        assert policy.select(workers, request, now=float(step)) == 1
    with pytest.raises(NoWorkerAvailable):
        policy.select(views(0, 0, down=(0, 1)), RequestView.from_prompt("x"), now=0.0)


def test_round_robin_takes_turns_and_skips_unhealthy() -> None:
    policy = create_policy("round_robin")
    request = RequestView.from_prompt("hi")
    assert [policy.select(views(0, 0, 0), request, 0.0) for _ in range(4)] == [0, 1, 2, 0]
    assert [policy.select(views(0, 0, 0, down=(2,)), request, 0.0) for _ in range(3)] == [1, 0, 1]


def test_random_is_seeded_and_uses_every_worker() -> None:
    request = RequestView.from_prompt("hi")
    runs = []
    for _ in range(2):
        policy = create_policy("random", seed=7)
        runs.append([policy.select(views(0, 0, 0), request, 0.0) for _ in range(100)])
    assert runs[0] == runs[1]
    assert set(runs[0]) == {0, 1, 2}


def test_power_of_two_and_least_load_prefer_the_less_loaded() -> None:
    request = RequestView.from_prompt("hi")
    assert create_policy("power_of_two").select(views(9, 2), request, 0.0) == 1
    assert create_policy("least_load").select(views(5, 3, 4), request, 0.0) == 1
    two = create_policy("power_of_two", seed=3)
    picks = Counter(two.select(views(0, 5, 9), request, 0.0) for _ in range(300))
    assert picks[2] == 0 and picks[0] > picks[1]


def test_cache_aware_hits_the_holder_and_select_leaves_the_tree_alone() -> None:
    policy = CacheAwarePolicy(NO_EVICTION)
    shared = RequestView.from_prompt("You are a helpful assistant. " * 20 + "Question one?")
    policy.on_dispatch("w2", shared, now=0.0)
    sizes = policy.tree_size()
    follow_up = RequestView.from_prompt("You are a helpful assistant. " * 20 + "Question two?")
    assert policy.select(views(3, 0, 4), follow_up, now=1.0) == 2
    assert policy.select(views(3, 0, 4), follow_up, now=1.0) == 2
    assert policy.tree_size() == sizes
    # A retry without w2 (failed) goes elsewhere and still leaves no trace.
    assert policy.select(views(3, 0, 4, down=(2,)), follow_up, now=1.0) == 1
    assert policy.tree_size() == sizes
    policy.on_dispatch("w2", follow_up, now=1.0)
    assert policy.expected_hit_rate() > 0.45


def test_cache_aware_namespaces_do_not_share_hits() -> None:
    policy = CacheAwarePolicy(NO_EVICTION)
    text = "a long shared system prompt " * 10
    policy.on_dispatch("w0", RequestView.from_prompt(text, model="m", lora="a"), now=0.0)
    policy.on_dispatch("w1", RequestView.from_prompt(text + "x", model="m"), now=0.0)
    other = RequestView.from_prompt(text + "y", model="m", lora="a")
    assert policy.select(views(0, 0, 0), other, now=1.0) == 0
    ids = RequestView.from_prompt(text, input_ids=list(range(100)), model="m", lora="a")
    assert policy.select(views(0, 0, 0), ids, now=1.0) == 2
    salted = RequestView.from_prompt(text + "y", model="m", lora="a", cache_salt="user-2")
    assert policy.select(views(0, 0, 0), salted, now=1.0) == 2


@pytest.mark.parametrize(("threshold", "holder_wins"), [(0.3, True), (0.5, False)])
def test_cache_threshold_decides_between_the_holder_and_placement(threshold, holder_wins) -> None:
    policy = CacheAwarePolicy(
        CachePolicyConfig(eviction_interval_secs=0, cache_threshold=threshold)
    )
    policy.on_dispatch("w0", RequestView.from_prompt("s" * 400), now=0.0)
    policy.on_dispatch("w1", RequestView.from_prompt("t" * 40), now=0.0)
    partly_held = RequestView.from_prompt("s" * 160 + "u" * 240)  # w0 holds 40% of it
    assert policy.select(views(0, 0, 0), partly_held, now=1.0) == (0 if holder_wins else 2)


@pytest.mark.parametrize(
    ("abs_threshold", "rel_threshold", "holder_load", "stays"),
    [
        (32, 1.0001, 40, True),  # 30 above the floor: inside the absolute band
        (32, 1.0001, 50, False),  # beyond both bands: overloaded
        (100, 1.0001, 90, True),  # a wider absolute band tolerates it
        (32, 10.0, 90, True),  # 9x the floor is inside a 10x relative band
    ],
)
def test_balance_thresholds_bound_what_locality_may_cost(
    abs_threshold, rel_threshold, holder_load, stays
) -> None:
    config = CachePolicyConfig(
        eviction_interval_secs=0,
        balance_abs_threshold=abs_threshold,
        balance_rel_threshold=rel_threshold,
    )
    policy = CacheAwarePolicy(config)
    policy.on_dispatch("w0", RequestView.from_prompt("h" * 400), now=0.0)
    ask = RequestView.from_prompt("h" * 400 + "more")
    assert (policy.select(views(holder_load, 10), ask, now=1.0) == 0) == stays


def test_cache_aware_miss_goes_to_the_smallest_tree() -> None:
    policy = CacheAwarePolicy(NO_EVICTION)
    policy.on_dispatch("w0", RequestView.from_prompt("x" * 800), now=0.0)
    policy.on_dispatch("w1", RequestView.from_prompt("y" * 80), now=0.0)
    assert policy.select(views(1, 1, 1), RequestView.from_prompt("z" * 400), now=1.0) == 2


def test_removed_worker_is_forgotten() -> None:
    policy = CacheAwarePolicy(NO_EVICTION)
    request = RequestView.from_prompt("p" * 400)
    policy.on_dispatch("w0", request, now=0.0)
    policy.on_worker_removed("w0")
    assert "w0" not in policy.tree_size()
    policy.tree.check_integrity()


def test_eviction_runs_on_the_interval_and_zero_disables_it() -> None:
    config = CachePolicyConfig(eviction_interval_secs=10, max_tree_size=220)
    policy = CacheAwarePolicy(config)
    for i in range(2):  # 50 units and a node (60) each: at the cap, not over it
        policy.on_dispatch("w0", RequestView.from_prompt(f"{i}" * 400), now=float(i))
    assert policy.tree_size()["w0"] == 100
    policy.tick(now=100.0)
    assert policy.tree_size()["w0"] == 50  # trimmed below 7/8 of the cap, oldest first
    policy.on_dispatch("w0", RequestView.from_prompt("9" * 400), now=101.0)
    policy.tick(now=105.0)
    assert policy.tree_size()["w0"] == 100
    policy.tick(now=110.0)
    assert policy.tree_size()["w0"] == 50
    frozen = CacheAwarePolicy(CachePolicyConfig(eviction_interval_secs=0, max_tree_size=1))
    frozen.on_dispatch("w0", RequestView.from_prompt("9" * 400), now=0.0)
    frozen.tick(now=1e9)
    assert frozen.tree_size()["w0"] == 50


def test_tree_size_cap_holds_between_ticks() -> None:
    # However fast requests come, no worker's tree outgrows the cap before the next tick.
    # A prompt of 50 units costs 110 with its node: the cap holds 7 of them per worker.
    policy = CacheAwarePolicy(CachePolicyConfig(eviction_interval_secs=60, max_tree_size=800))
    for i in range(200):
        policy.on_dispatch(f"w{i % 2}", RequestView.from_prompt(f"{i:04d}" * 100), now=i / 1e3)
        assert max(policy.tree.cost(w) for w in ("w0", "w1")) <= 800
    assert min(policy.tree_size().values()) >= 300  # trimmed to 7/8 of the cap, not emptied
    latest = RequestView.from_prompt("0199" * 100)
    assert policy.tree.prefix_match_tenant(latest.key, "w1", latest.namespace) == 50  # LRU kept
    policy.tree.check_integrity()


def test_overloaded_worker_gets_no_new_prefixes() -> None:
    # w0 serves one hot prefix: the smallest tree but by far the highest load (still inside
    # the 32-request band, so sglang-router would call the fleet balanced and pick w0).
    policy = CacheAwarePolicy(NO_EVICTION)
    rng = random.Random(0)
    policy.on_dispatch("w0", RequestView.from_prompt(prompt(rng, 200)), now=0.0)
    for wid in ("w1", "w2", "w3"):
        policy.on_dispatch(wid, RequestView.from_prompt(prompt(rng, 2000)), now=0.0)
    loads = [40, 10, 12, 11]
    for step in range(1, 31):
        request = RequestView.from_prompt(prompt(rng, 2000))
        pick = policy.select(views(*loads), request, float(step))
        assert pick != 0
        policy.on_dispatch(f"w{pick}", request, float(step))
        loads[pick] += 1
    assert min(policy.tree_size(), key=policy.tree_size().get) == "w0"
    # Beyond the band (sglang's imbalance), too, whatever the tree sizes.
    assert policy.select(views(90, 10, 10, 10), RequestView.from_prompt("n" * 99), 2.0) != 0


def test_a_momentary_load_spike_does_not_cost_a_worker_its_new_prefixes() -> None:
    policy = CacheAwarePolicy(NO_EVICTION)
    rng = random.Random(2)
    for wid in ("w1", "w2", "w3"):
        policy.on_dispatch(wid, RequestView.from_prompt(prompt(rng, 2000)), now=0.0)
    for t in range(10):  # ten seconds of even load
        policy.select(views(3, 3, 3, 3), RequestView.from_prompt("probe"), now=float(t))
    new = RequestView.from_prompt(prompt(rng, 2000))
    # w0 (the smallest tree) stalls for 5 ms and gathers the in-flight requests: still its turn.
    assert policy.select(views(11, 0, 0, 1), new, now=10.005) == 0
    # Busy for seconds: then new prefixes go elsewhere.
    picks = [policy.select(views(11, 0, 0, 1), new, now=10.0 + k / 10) for k in range(1, 40)]
    assert picks[-1] != 0


def test_a_hot_prefix_spills_only_its_holders_excess() -> None:
    policy = CacheAwarePolicy(NO_EVICTION)
    hot, cold = "h" * 800, "c" * 800
    policy.on_dispatch("w0", RequestView.from_prompt(hot), now=0.0)
    policy.on_dispatch("w1", RequestView.from_prompt(cold), now=0.0)
    rng, sent = random.Random(3), {"hot": Counter[int](), "cold": Counter[int]()}
    for step in range(1000):  # 60% of the traffic shares one prefix; loads stay even
        group = "hot" if rng.random() < 0.6 else "cold"
        ask = RequestView.from_prompt((hot if group == "hot" else cold) + f"{step}")
        pick = policy.select(views(2, 2), ask, now=step / 100)
        policy.on_dispatch(f"w{pick}", ask, now=step / 100)
        sent[group][pick] += 1
    assert sent["cold"][0] == 0  # the cold prefix's holder was never over its share
    hot_share = sent["hot"][0] / sum(sent["hot"].values())
    assert 0.75 < hot_share < 0.9  # home keeps most; only the excess (~17%) moved
    total = [sent["hot"][i] + sent["cold"][i] for i in (0, 1)]
    assert max(total) <= 1.05 * sum(total) / 2 + 36


def test_share_slack_inf_keeps_every_hit_home() -> None:
    policy = CacheAwarePolicy(CachePolicyConfig(eviction_interval_secs=0, share_slack=math.inf))
    policy.on_dispatch("w0", RequestView.from_prompt("h" * 800), now=0.0)
    for step in range(300):
        ask = RequestView.from_prompt("h" * 800 + f"{step}")
        assert policy.select(views(2, 2), ask, now=float(step)) == 0
        policy.on_dispatch("w0", ask, now=float(step))


def test_imbalance_only_diverts_the_overloaded_workers_traffic() -> None:
    policy = CacheAwarePolicy(NO_EVICTION)
    rng = random.Random(1)
    groups = [prompt(rng, 2000) for _ in range(4)]
    for i, text in enumerate(groups):
        for step in range(3):
            policy.on_dispatch(f"w{i}", RequestView.from_prompt(text + f"{step}"), float(step))
    overloaded = views(80, 20, 25, 5)  # w0 exceeds the band; w3 is the least loaded
    for i in (1, 2, 3):
        ask = RequestView.from_prompt(groups[i] + prompt(rng, 50))
        assert policy.select(overloaded, ask, now=5.0) == i
    spilled = RequestView.from_prompt(groups[0] + "spill")
    pick = policy.select(overloaded, spilled, now=5.0)
    assert pick != 0
    policy.on_dispatch(f"w{pick}", spilled, now=5.0)
    # Once w0 is back in the band its prefix goes home, though the spill target is fresher.
    back = RequestView.from_prompt(groups[0] + "back")
    assert policy.select(views(30, 20, 25, 5), back, now=6.0) == 0


@pytest.mark.parametrize(
    ("per_step", "service_steps", "seed"),
    [(4, 8, 0), (4, 8, 1), (8, 64, 2)],  # 32 in flight like the benchmark; 512 in flight
)
def test_sixteen_prefix_groups_stay_put_and_load_stays_even(
    per_step: int, service_steps: int, seed: int
) -> None:
    rng = random.Random(seed)
    fleet = Fleet(CacheAwarePolicy(NO_EVICTION), workers=4, service_steps=service_steps)
    prefixes = [prompt(rng, 4000) for _ in range(16)]
    placement: list[Counter[int]] = [Counter() for _ in prefixes]
    in_flight = [0] * 4
    for step in range(1200):
        fleet.advance(step)
        for _ in range(per_step):
            group = rng.randrange(16)
            request = RequestView.from_prompt(prefixes[group] + prompt(rng, 200))
            placement[group][fleet.route(request, step)] += 1
        in_flight = [a + b for a, b in zip(in_flight, fleet.loads)]
    affinity = [max(c.values()) / sum(c.values()) for c in placement]
    assert min(affinity) >= 0.95
    assert max(fleet.sent.values()) <= 1.10 * sum(fleet.sent.values()) / 4
    assert max(in_flight) <= 1.10 * sum(in_flight) / 4
    fleet.policy.tree.check_integrity()


def test_request_key_and_namespace() -> None:
    chat = request_view({"messages": [{"role": "user", "content": "hi"}], "model": "m"})
    assert chat.namespace[1] == "m" and chat.key == text_key("<user>hi\n")
    ids = request_view({"input_ids": [1, 2, 3], "lora_path": "a", "cache_salt": "s"})
    assert ids.key == ids_key([1, 2, 3]) and ids.namespace[2:] == (namespace_string("a", "s"),)
    assert ids.kv_namespace == namespace_string("a", "s")  # the tree's and the index's agree
    assert request_view({"prompt": [5, 6]}).key == ids_key([5, 6])
    assert request_view({"text": "abc"}).namespace != request_view({"input_ids": [1]}).namespace
