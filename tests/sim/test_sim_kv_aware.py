"""The simulator feeds kv_aware's index from the engines' own radix caches (issue 12, acceptance
4): after a run under KV pressure, the index holds exactly the blocks each engine's tracker says
its cache holds, and everything recounts."""

from __future__ import annotations

from radixserve.config import CacheConfig
from radixserve.sim.cluster import ClusterConfig, ClusterSim
from radixserve.sim.runner import SimRunner
from radixserve.sim.workloads import MultiTurnConfig, multi_turn_chat

CHAT = MultiTurnConfig(num_sessions=24, turns=3, system_prompt_len=256, user_len=64,
                       output_len=16, think_time_s=0.5, request_rate=20.0)  # fmt: skip


def test_index_mirrors_every_engine_cache_under_pressure():
    reqs = multi_turn_chat(CHAT, SimRunner("llama3-8b-h100").generate)
    sim = ClusterSim(
        ClusterConfig(engines=3, router="kv_aware", preset="llama3-8b-h100"),
        cache_config=CacheConfig(max_total_tokens=1200),  # a few sessions' histories: evictions
    )
    res = sim.run(reqs)
    assert res.num_unfinished == 0 and res.num_finished == len(reqs)
    sim._feed.flush()
    sim.check_integrity()  # schedulers, trackers (recount from the trees) and the index
    trackers = sim._feed.trackers
    assert sim.policy.index.blocks() == {i: t.num_blocks for i, t in enumerate(trackers)}
    assert sim.policy.index.stats.removed > 0  # the pressure did evict, and the index saw it
    assert sim.policy.expected_hit_rate() > 0.3
