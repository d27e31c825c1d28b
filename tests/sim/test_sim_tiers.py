"""The simulator's lower KV tiers (issue 27 item 6): each engine's host tier and a fleet-wide
KV store. A prefix computed on one engine is loaded by another from the store instead of being
recomputed, paying its copy time in its TTFT; every tier stays within its capacity; the hits
by tier add up to the hit rate; `radixserve sim` reports them."""

from __future__ import annotations

import random

import pytest

from radixserve.cli import main
from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sim.cluster import ClusterConfig, ClusterSim
from radixserve.sim.costmodel import get_cost_model
from radixserve.sim.report import SimResult
from radixserve.sim.runner import SimRunner
from radixserve.sim.tiers import Landing, SimTierConfig, split_by_tier
from radixserve.sim.workloads import (
    MultiTurnConfig,
    WorkloadRequest,
    ideal_prefix_hit_rate,
    multi_turn_chat,
)

PRESET = "tiny-cpu"
COST = get_cost_model(PRESET)
PROMPT = 2000


def store_gb(tokens: int) -> float:
    return tokens * COST.model.kv_bytes_per_token / 1e9


def run(
    reqs: list[WorkloadRequest],
    cache: CacheConfig | None = None,
    tiers: SimTierConfig | None = None,
    **kw: object,
) -> tuple[ClusterSim, SimResult]:
    cfg = ClusterConfig(**{"engines": 2, "preset": PRESET, "tiers": tiers or SimTierConfig(), **kw})  # type: ignore[arg-type]
    sim = ClusterSim(cfg, cache_config=cache or CacheConfig(max_total_tokens=20_000))
    res = sim.run(reqs)
    sim.check_integrity()  # device and host tiers, the router's index, the store
    assert res.num_unfinished == 0 == res.num_rejected
    return sim, res


def two_of_one_prompt(gap_s: float = 1.0) -> list[WorkloadRequest]:
    """One prompt sent twice, the second long after the first finished: round robin puts the
    two on different engines."""
    ids = random.Random(1).choices(range(1, 30_000), k=PROMPT)
    return [WorkloadRequest("a", 0.0, ids, 4), WorkloadRequest("b", gap_s, list(ids), 4)]


def chat(sessions: int = 24, turns: int = 4) -> list[WorkloadRequest]:
    cfg = MultiTurnConfig(
        num_sessions=sessions, turns=turns, system_prompt_len=256, user_len=64, output_len=32,
        think_time_s=0.05, request_rate=400.0,
    )  # fmt: skip
    return multi_turn_chat(cfg, SimRunner(PRESET).generate)


def test_a_store_hit_on_another_engine_loads_instead_of_recomputing() -> None:
    reqs = two_of_one_prompt()
    _, plain = run(reqs, router="round_robin")
    tiers = SimTierConfig(kv_store_gb=store_gb(100_000))
    sim, res = run(reqs, tiers=tiers, router="round_robin")
    assert plain.cached_tokens == 0  # the second engine never saw the prompt
    # engine 1 loaded every whole store block before the last token from the store
    loaded = (PROMPT - 1) // 16 * 16
    assert res.tier_tokens == {"device": 0, "host": 0, "store": loaded}
    assert res.cached_tokens == loaded and res.engines[1].cached_tokens == loaded
    assert len(res.tier_ttft["store"]) == 1 and len(res.tier_ttft["miss"]) == 1
    assert sim.store is not None and sim.store.read == loaded // 16
    # the load is cheaper than the prefill it replaces, and costs what the tiers say
    store_ttft, cold_ttft = res.tier_ttft["store"][0], plain.ttft[1]
    assert store_ttft < cold_ttft
    spec = sim.tier_spec
    expected = COST.store_load_time(loaded, spec) + COST.host_load_time(loaded, spec)
    expected += COST.step_time([(PROMPT - loaded, loaded, True)])
    assert store_ttft == pytest.approx(expected, rel=1e-6)


def test_store_load_time_follows_the_bandwidth_and_latency() -> None:
    reqs = two_of_one_prompt()
    ttft = {}
    for gbs, ms in ((5.0, 0.01), (0.5, 0.01), (5.0, 20.0)):
        tiers = SimTierConfig(
            kv_store_gb=store_gb(100_000), store_bandwidth_gbs=gbs, store_latency_ms=ms
        )
        _, res = run(reqs, tiers=tiers, router="round_robin")
        ttft[gbs, ms] = res.tier_ttft["store"][0]
    loaded = (PROMPT - 1) // 16 * 16
    per_token = COST.kv_bytes_per_token_per_gpu
    # a tenth of the bandwidth: nine more transfer times of the same bytes
    assert ttft[0.5, 0.01] - ttft[5.0, 0.01] == pytest.approx(
        loaded * per_token * (1 / 0.5e9 - 1 / 5e9), rel=1e-6
    )
    assert ttft[5.0, 20.0] - ttft[5.0, 0.01] == pytest.approx(0.01999, rel=1e-6)


def test_host_hits_pay_the_host_copy_in_the_step() -> None:
    """A prefix evicted to the host tier comes back at the host bandwidth: the slower the
    copy, the longer the TTFT of the request that needs it, by exactly the copy time."""
    ids = random.Random(2).choices(range(1, 30_000), k=PROMPT)
    other = random.Random(3).choices(range(1, 30_000), k=PROMPT)
    reqs = [  # one engine: the other prompt evicts the first to the host tier
        WorkloadRequest("a", 0.0, ids, 4),
        WorkloadRequest("x", 1.0, other, 4),
        WorkloadRequest("b", 2.0, list(ids), 4),
    ]
    cache = CacheConfig(max_total_tokens=2100, enable_hierarchical_cache=True, hicache_ratio=4.0)
    ttft = {}
    for gbs in (10.0, 1.0):
        tiers = SimTierConfig(host_bandwidth_gbs=gbs)
        _, res = run(reqs, cache, tiers, engines=1)
        assert res.tier_tokens["host"] == PROMPT - 1 and res.tier_tokens["store"] == 0
        ttft[gbs] = res.tier_ttft["host"][0]
    copy = (PROMPT - 1) * COST.kv_bytes_per_token_per_gpu
    assert ttft[1.0] - ttft[10.0] == pytest.approx(copy * (1 / 1e9 - 1 / 10e9), rel=1e-6)
    _, off = run(reqs, CacheConfig(max_total_tokens=2100), engines=1)
    assert off.cached_tokens == 0  # without the host tier the prefix is recomputed


def test_tiers_keep_their_accounting_and_capacity_on_chat() -> None:
    """Multi-turn chat on pools far too small: every tier evicts. The hits by tier add up,
    neither lower tier outgrows its capacity, and the fleet reaches nearly what one
    unbounded cache would."""
    reqs = chat()
    cache = CacheConfig(max_total_tokens=1500, enable_hierarchical_cache=True, hicache_ratio=2.0)
    tiers = SimTierConfig(kv_store_gb=store_gb(6000))
    sim, res = run(reqs, cache, tiers, engines=4, router="kv_aware")
    assert sum(res.tier_tokens.values()) == res.cached_tokens
    assert sum(len(v) for v in res.tier_ttft.values()) == len(reqs)
    assert all(res.tier_tokens[t] > 0 for t in ("device", "host", "store"))
    store = sim.store
    assert store is not None and store.evicted > 0 and len(store) <= store.capacity
    for eng in sim.engines:
        host = eng.sched.kv.host
        assert host is not None and eng.sched.cache.host_size() <= host.total
    _, device_only = run(reqs, CacheConfig(max_total_tokens=1500), engines=4, router="kv_aware")
    assert res.hit_rate > device_only.hit_rate + 0.05
    runner = SimRunner(PRESET)
    best = ideal_prefix_hit_rate(reqs, 1, lambda r: runner.generate(r.input_ids, r.output_len))
    big = SimTierConfig(kv_store_gb=store_gb(200_000))
    _, whole = run(reqs, cache, big, engines=4, router="kv_aware")
    assert whole.hit_rate >= 0.95 * best


def test_split_by_tier() -> None:
    assert split_by_tier(100, 0, None) == {"device": 100, "host": 0, "store": 0}
    assert split_by_tier(100, 20, None) == {"device": 80, "host": 20, "store": 0}
    # device 0-32, host revived 32-48, store 48-96, then the scheduler's own host load
    got = split_by_tier(110, 14, Landing(32, 16, 48))
    assert got == {"device": 32, "host": 30, "store": 48}


def test_kv_aware_scores_the_store_and_engines_report_their_ratio() -> None:
    tiers = SimTierConfig(kv_store_gb=1.0)
    sim, _ = run(two_of_one_prompt(), tiers=tiers, router="kv_aware")
    assert sim._store_source in sim.policy.lower and sim.engines[0].ratio == pytest.approx(
        COST.load_to_prefill_ratio(sim.tier_spec)
    )
    off, _ = run(two_of_one_prompt(), tiers=SimTierConfig(kv_store_gb=1.0, tier_aware=False),
                 router="kv_aware")  # fmt: skip
    assert off._store_source not in off.policy.lower  # (the host tier kv_aware always reads)


def test_engines_report_their_cost_model_s_ratios_to_the_router() -> None:
    """What the sim's router is given (each engine's reported view): the cost model's host
    ratio where engines have a host tier, its store ratio (host copy included) where there is
    a store; None for a tier they lack (kv_aware then charges its default)."""
    cache = CacheConfig(max_total_tokens=20_000, enable_hierarchical_cache=True)
    sim, _ = run(two_of_one_prompt(), cache=cache, tiers=SimTierConfig(kv_store_gb=1.0),
                 router="kv_aware")  # fmt: skip
    seen = sim.engines[1].reported_view(0.0)
    host = COST.host_load_to_prefill_ratio(sim.tier_spec)
    assert seen.kv_load_ratio == pytest.approx(host) and host > 0
    assert seen.kv_store_load_ratio == pytest.approx(COST.load_to_prefill_ratio(sim.tier_spec))
    assert seen.kv_store_load_ratio > seen.kv_load_ratio
    assert sim.tier_report()["host_load_to_prefill_ratio"] == pytest.approx(host)
    bare, _ = run(two_of_one_prompt(), router="kv_aware")
    seen = bare.engines[0].reported_view(0.0)
    assert seen.kv_load_ratio is None and seen.kv_store_load_ratio is None


def test_cli_reports_hits_and_ttft_by_tier(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "sim", "--workload", "multi-turn", "--num-sessions", "12", "--turns", "3",
        "--preset", PRESET, "--engines", "2", "--router", "kv_aware", "--max-total-tokens", "1500",
        "--enable-hierarchical-cache", "--kv-store-gb", "0.01", "--store-bandwidth-gbs", "2",
        "--no-progress",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "host tier: 131,072 KV tokens per engine, copies at 10 GB/s" in out
    assert "KV store: 19,531 tokens (0.01 GB) for the fleet, 2 GB/s" in out
    assert "kv_aware: hits by tier device" in out and "TTFT mean/p99 s by lowest tier" in out


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--kv-store-gb", "-1", "must be >= 0"),
        ("--store-bandwidth-gbs", "0", "must be > 0"),
        ("--store-block-tokens", "0", "must be >= 1"),
    ],
)
def test_bad_tier_flags_are_one_line_errors(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["sim", "--preset", PRESET, flag, value, "--no-progress"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0] and flag in err[0]


def test_a_prefix_evicted_while_waiting_is_loaded_from_the_store_at_admission() -> None:
    """Turn two's history is on its engine when it arrives (nothing to fetch then), but two
    long requests ahead of it in the queue take the pool and evict it while it waits: at
    admission the engine looks the store up again and loads it instead of recomputing."""
    rng = random.Random(2)
    hist = rng.choices(range(1, 30_000), k=PROMPT)
    fillers = [rng.choices(range(1, 30_000), k=PROMPT) for _ in range(2)]
    reqs = [
        WorkloadRequest("turn1", 0.0, hist, 4),
        *(WorkloadRequest(f"f{i}", 1.0, ids, 200) for i, ids in enumerate(fillers)),
        WorkloadRequest("turn2", 1.0, hist + rng.choices(range(1, 30_000), k=100), 4),
    ]
    cfg = ClusterConfig(
        engines=1, preset=PRESET, router="round_robin",
        tiers=SimTierConfig(kv_store_gb=store_gb(100_000)),
    )  # fmt: skip
    sim = ClusterSim(
        cfg, SchedulerConfig(schedule_policy="fcfs"), CacheConfig(max_total_tokens=5000)
    )
    res = sim.run(reqs)
    sim.check_integrity()
    assert res.num_unfinished == 0 == res.num_rejected
    assert sim.refetched == 1  # turn two, at admission (not at dispatch: no landing then)
    assert res.tier_tokens == {"device": 0, "host": 0, "store": PROMPT}
    assert res.cached_tokens == PROMPT  # without the refetch: 0, all recomputed
    assert len(res.tier_ttft["store"]) == 1 and len(res.tier_ttft["miss"]) == 3
    assert sim.store is not None and sim.store.read == PROMPT // 16
