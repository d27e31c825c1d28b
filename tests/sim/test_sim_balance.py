"""cache_aware keeps chat sessions that share a system prompt spread over the engines: every
engine that holds the prompt serves a new session from cache, so new sessions go to the one
sent the least, not all to the prompt's first holder (issue 17, point 7)."""

from __future__ import annotations

from radixserve.sim.cluster import ClusterConfig, simulate
from radixserve.sim.runner import SimRunner
from radixserve.sim.workloads import MultiTurnConfig, multi_turn_chat


def test_chat_sessions_sharing_a_system_prompt_spread_over_sixteen_engines() -> None:
    cfg = MultiTurnConfig(num_sessions=160, turns=6, request_rate=2.0, think_time_s=10.0)
    reqs = multi_turn_chat(cfg, SimRunner("llama3-8b-h100").generate)
    res = simulate(reqs, ClusterConfig(engines=16))
    imbalance = res.imbalance()
    # before: the busiest engine got 1.73x the mean requests and 1.61x the mean busy time
    assert imbalance["requests"] <= 1.25
    assert imbalance["busy_s"] <= 1.4
    assert res.hit_rate >= 0.88  # and the hit rate rose (0.876 before)
