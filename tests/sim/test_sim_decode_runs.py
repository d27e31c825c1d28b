"""The simulator's fast path: runs of pure decode steps booked as one event give exactly the
results of stepping one by one (every latency, hit, busy second and step), on the Mooncake
trace, chat sessions that cut runs short, a concurrency limit, small KV pools and pages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.batch import Batch, BatchEntry
from radixserve.sim.cluster import ClusterConfig, ClusterSim
from radixserve.sim.costmodel import LLAMA3_8B, CostModel, GpuSpec, get_cost_model
from radixserve.sim.runner import SimRunner
from radixserve.sim.tiers import SimTierConfig
from radixserve.sim.workloads import (
    MultiTurnConfig,
    SharedPrefixConfig,
    TraceConfig,
    WorkloadRequest,
    generated_shared_prefix,
    multi_turn_chat,
    trace_replay,
)


def both(
    reqs: list[WorkloadRequest], cache: CacheConfig, sched: SchedulerConfig | None = None, **kw: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
    """The results (and per-request latencies) of the fast path and of single steps."""
    out = []
    for fast in (True, False):
        sim = ClusterSim(ClusterConfig(decode_runs=fast, **kw), sched, cache)
        res = sim.run(reqs, block_tokens=16)
        sim.check_integrity()
        assert res.num_unfinished == 0
        doc = res.to_dict()
        for k in ("wall_s", "sim_requests_per_min"):
            del doc[k]
        doc["latencies"] = (res.ttft, res.tpot, res.e2e, res.wait, res.tbt_worst, res.tbt_hist)
        doc["trees"] = [(e.sched.cache.evictable_size(), e.sched.stats()) for e in sim.engines]
        out.append((doc, sim.run_counts))
    (fast, counts), (slow, none) = out
    assert none["runs"] == 0
    return fast, slow, counts


def test_the_mooncake_trace_gives_the_same_results_in_far_fewer_events(
    mooncake_trace: Path,
) -> None:
    reqs = trace_replay(TraceConfig(path=str(mooncake_trace), block_tokens=16, limit=400))
    fast, slow, counts = both(reqs, CacheConfig(page_size=16, max_total_tokens=60_000), engines=4)
    assert fast == slow
    assert counts["steps"] > 10 * counts["runs"] > 0  # most decode steps ran inside runs
    assert counts["cuts"] > 0  # open-loop arrivals cut runs short


@pytest.mark.parametrize(
    ("router", "tiers"),
    [("cache_aware", False), ("kv_aware", False), ("kv_aware", True)],
)
def test_runs_that_evict_from_a_full_pool_give_the_same_results(
    mooncake_trace: Path, router: str, tiers: bool
) -> None:
    # a pool far smaller than the trace's working set: most decode steps must evict. A run
    # makes each step's eviction when that step begins, so kv_aware's index (fed by the
    # engines' trees), a store lookup's match and every later hit see what single steps left
    reqs = trace_replay(TraceConfig(path=str(mooncake_trace), block_tokens=16, limit=300))
    cache = CacheConfig(page_size=16, max_total_tokens=4_000, enable_hierarchical_cache=tiers)
    kw: dict[str, Any] = {"tiers": SimTierConfig(kv_store_gb=0.5)} if tiers else {}
    fast, slow, counts = both(reqs, cache, engines=4, router=router, **kw)
    assert fast == slow
    assert counts["evicting"] > counts["runs"] // 4 > 0  # evictions happened inside runs
    assert counts["steps"] > 5 * counts["runs"]


class _Watched(ClusterSim):
    """Notes the tree sizes of the engines whose trees a dispatch reads, each time a request is
    dispatched: every engine's under kv_aware (its index follows them all), else the engine
    the request went to (the request is matched there)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: list[list[int]] = []

    def _dispatch(self, i: int) -> None:
        super()._dispatch(i)
        live = self._live.get(self._reqs[i].rid)  # None: refused (too long for the pool)
        engines = self.engines if self._feed is not None or live is None else [live[1]]
        self.seen.append([e.sched.cache.total_size() for e in engines])


@pytest.mark.parametrize("router", ["cache_aware", "kv_aware"])
def test_a_dispatch_during_a_run_finds_the_trees_single_steps_leave(
    mooncake_trace: Path, router: str
) -> None:
    # a dispatch reads trees (kv_aware's index, the chosen engine's match, a store lookup's):
    # the evictions of the run's steps begun by then are made, those of later steps are not yet
    reqs = trace_replay(TraceConfig(path=str(mooncake_trace), block_tokens=16, limit=300))
    cache = CacheConfig(page_size=16, max_total_tokens=4_000)
    config = [ClusterConfig(engines=4, router=router, decode_runs=f) for f in (True, False)]
    sims = [_Watched(c, None, cache) for c in config]
    for sim in sims:
        sim.run(reqs, block_tokens=16)
    assert sims[0].run_counts["evicting"] > 0
    assert sims[0].seen == sims[1].seen


def test_chat_sessions_and_a_concurrency_limit_cut_runs_exactly() -> None:
    chat = MultiTurnConfig(
        num_sessions=24, turns=4, output_len=96, think_time_s=0.05, request_rate=20.0
    )
    reqs = multi_turn_chat(chat, SimRunner("llama3-8b-h100").generate)
    fast, slow, counts = both(reqs, CacheConfig(max_total_tokens=30_000), engines=3)
    assert fast == slow and counts["cuts"] > 0
    gsp = SharedPrefixConfig(num_groups=6, prompts_per_group=8, system_prompt_len=300,
                             output_len=80, range_ratio=0.2, request_rate=40.0)  # fmt: skip
    reqs = generated_shared_prefix(gsp)
    fast, slow, counts = both(reqs, CacheConfig(max_total_tokens=20_000), max_concurrency=5)
    assert fast == slow and counts["runs"] > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_pool_that_forces_retraction_still_matches(page_size: int) -> None:
    # arrivals during runs are admitted against the KV reserved for the running decodes, which
    # shrinks every decode step: a run must leave that reservation where single steps would
    gsp = SharedPrefixConfig(num_groups=4, prompts_per_group=8, system_prompt_len=200,
                             output_len=300, range_ratio=0.1, request_rate=30.0)  # fmt: skip
    reqs = generated_shared_prefix(gsp)
    sched = SchedulerConfig(schedule_policy="fcfs")
    cache = CacheConfig(page_size=page_size, max_total_tokens=3_000)
    fast, slow, counts = both(reqs, cache, sched, engines=2)
    assert fast == slow and counts["runs"] > 0


# a GPU whose memory is so fast that decode attention is bound by its FLOPs: the durations
# then take the roofline's max() step by step (every preset reads KV slower than it computes)
FAST_MEMORY = CostModel("fast-memory", LLAMA3_8B, GpuSpec("fast-memory", 1e13, 1e16, 80e9, 1e11))


def test_decode_durations_equal_the_step_timer_float_for_float() -> None:
    presets = ("llama3-70b-tp4-h100", "llama3-8b-a100", "tiny-cpu")
    for cost in (*map(get_cost_model, presets), FAST_MEMORY):
        runner = SimRunner(cost)
        timer = cost.timer()
        # small contexts take the integer path, a huge one the entry-by-entry float path
        for contexts in ([5, 900, 17_000, 3], [2**44, 7]):
            got = runner.decode_durations(contexts, 40)
            want = [timer([(1, c + j, False) for c in contexts]) for j in range(40)]
            assert got == want  # exact, not approximately
    # tokens: a decode entry's next token at each step, as ``run`` gives it
    lasts, seq = [7], 99
    for _ in range(3):
        entry = BatchEntry("r", [lasts[-1]], seq, [], True, None, False, 1)  # type: ignore[arg-type]
        lasts.append(runner.run(Batch([entry], 1)).next_token_ids[0])  # type: ignore[arg-type]
        seq += 1
    assert runner.decode_tokens([7], [99], 3) == [lasts[1:]]
