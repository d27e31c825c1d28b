"""The cluster simulator: cache-aware routing and scheduling pay off as claimed, no request is
lost, trace replay reaches the trace's known hit rate, and `radixserve sim` prints its table."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from radixserve.cli import main
from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.request import Req
from radixserve.sim.cluster import ClusterConfig, ClusterSim, simulate
from radixserve.sim.report import SimResult, format_table
from radixserve.sim.runner import SimRunner
from radixserve.sim.workloads import (
    MultiTurnConfig,
    SharedPrefixConfig,
    TraceConfig,
    WorkloadRequest,
    block_hit_rate,
    generated_shared_prefix,
    ideal_prefix_hit_rate,
    multi_turn_chat,
    read_trace,
    trace_replay,
)

CACHE = CacheConfig(max_total_tokens=200_000)


def groups(**kw: object) -> list[WorkloadRequest]:
    base = dict(num_groups=8, prompts_per_group=8, system_prompt_len=1024, question_len=32)
    return generated_shared_prefix(SharedPrefixConfig(**{**base, "output_len": 4, **kw}))


def run(reqs: list[WorkloadRequest], cache: CacheConfig = CACHE, **kw: object) -> ClusterSim:
    sim = ClusterSim(ClusterConfig(**{"engines": 4, **kw}), cache_config=cache)  # type: ignore[arg-type]
    sim.result = sim.run(reqs)  # type: ignore[attr-defined]
    sim.check_integrity()
    return sim


def test_cache_aware_routing_hits_the_best_placement_and_beats_round_robin() -> None:
    reqs = groups()
    best = ideal_prefix_hit_rate(reqs)
    rr = run(reqs, router="round_robin").result  # type: ignore[attr-defined]
    ca = run(reqs, router="cache_aware").result  # type: ignore[attr-defined]
    for res in (rr, ca):
        assert res.num_finished == len(reqs) and res.num_unfinished == 0
        assert res.output_tokens == 4 * len(reqs)
    assert ca.hit_rate >= 0.95 * best
    assert ca.hit_rate > rr.hit_rate + 0.1
    assert ca.output_throughput > rr.output_throughput
    assert ca.imbalance()["requests"] <= 1.10  # 8 equal groups on 4 engines: 2 each


def test_a_burst_is_spread_over_engines_and_latencies_are_ordered() -> None:
    res = run(groups(num_groups=4), router="round_robin").result  # type: ignore[attr-defined]
    assert [e.requests for e in res.engines] == [8, 8, 8, 8]
    assert all(e.busy_s > 0 and e.steps > 0 for e in res.engines)
    d = res.to_dict()
    for metric in ("ttft_s", "e2e_s", "tpot_s"):
        p = d[metric]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert d["ttft_s"]["p99"] <= d["e2e_s"]["p99"] <= res.duration_s


def test_lpm_beats_fcfs_on_one_engine_under_memory_pressure() -> None:
    """32 requests at once: 24 share a 2,000-token system prompt, 8 are unrelated."""
    rng = random.Random(0)
    system = [rng.randrange(32000) for _ in range(2000)]
    prompts = [system + [rng.randrange(32000) for _ in range(32)] for _ in range(24)]
    prompts += [[rng.randrange(32000) for _ in range(2032)] for _ in range(8)]
    rng.shuffle(prompts)
    reqs = [WorkloadRequest(f"r{i}", 0.0, p, 8) for i, p in enumerate(prompts)]
    best = ideal_prefix_hit_rate(reqs)
    hit = {}
    for policy in ("fcfs", "lpm"):
        res = simulate(
            reqs,
            ClusterConfig(engines=1),
            SchedulerConfig(schedule_policy=policy),
            CacheConfig(max_total_tokens=7000),
        )
        assert res.num_finished == 32
        hit[policy] = res.hit_rate
    assert hit["lpm"] >= 0.95 * best
    assert hit["fcfs"] < hit["lpm"] - 0.02  # FCFS recomputes the evicted system prompt


def test_mooncake_trace_replay_reaches_the_traces_block_hit_rate(mooncake_trace: Path) -> None:
    path = str(mooncake_trace)
    # 16 tokens per 512-token block and short outputs keep it fast; neither changes which
    # blocks repeat, so the hit rate is the trace's own
    reqs = trace_replay(TraceConfig(path=path, block_tokens=16))
    reqs = [dataclasses.replace(r, output_len=min(r.output_len, 2)) for r in reqs]
    unbounded = CacheConfig(page_size=16, max_total_tokens=sum(len(r.input_ids) for r in reqs))
    res = simulate(reqs, ClusterConfig(engines=1), cache_config=unbounded, block_tokens=16)
    assert res.num_finished == 3993
    ideal = block_hit_rate(read_trace(path))
    assert ideal == pytest.approx(0.64, abs=0.01)
    assert res.block_hit_rate == pytest.approx(ideal, abs=0.01)


def test_chat_turns_wait_for_the_previous_reply_and_reuse_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = SimRunner("llama3-8b-h100")
    cfg = MultiTurnConfig(num_sessions=6, turns=3, system_prompt_len=64, output_len=16)
    reqs = multi_turn_chat(cfg, runner.generate)
    done: dict[str, Req] = {}
    record = SimResult.record
    monkeypatch.setattr(
        SimResult, "record", lambda res, req: (done.update({req.rid: req}), record(res, req))
    )
    sim = run(reqs, engines=2)
    res = sim.result  # type: ignore[attr-defined]
    assert res.num_finished == 18
    # the closed loop: each turn is sent think_time_s after the previous reply ended
    follow = [r for r in reqs if r.prev_rid is not None]
    assert len(follow) == 12
    for r in follow:
        prev = done[r.prev_rid]
        assert prev.finish_time is not None and prev.finish_time > 0
        assert done[r.rid].arrival_time == pytest.approx(prev.finish_time + cfg.think_time_s)
    best = ideal_prefix_hit_rate(reqs, outputs=lambda r: runner.generate(r.input_ids, r.output_len))
    assert best > ideal_prefix_hit_rate(reqs)  # replies are part of the next prompt
    assert res.hit_rate >= 0.95 * best


def test_max_concurrency_bounds_requests_in_flight() -> None:
    reqs = groups(num_groups=2)
    sim = ClusterSim(ClusterConfig(engines=2, max_concurrency=3), cache_config=CACHE)
    seen = []
    original = sim._dispatch

    def watch(i: int) -> None:
        original(i)
        seen.append(sum(e.requests for e in sim.engines))

    sim._dispatch = watch  # type: ignore[method-assign]
    res = sim.run(reqs)
    assert res.num_finished == len(reqs)
    assert max(seen) == 3


def test_a_request_too_long_for_any_engine_is_rejected_not_lost() -> None:
    reqs = groups(num_groups=1, prompts_per_group=3)
    reqs.append(WorkloadRequest("huge", 0.0, list(range(5000)), 4))
    res = run(reqs, cache=CacheConfig(max_total_tokens=4096), engines=2).result  # type: ignore[attr-defined]
    assert (res.num_finished, res.num_rejected, res.num_unfinished) == (3, 1, 0)


def test_rejections_under_a_concurrency_limit_never_stall_the_backlog() -> None:
    huge = list(range(5000))  # more than the pool: every one is rejected, 600 in a row
    reqs = [WorkloadRequest(f"huge{i}", 0.0, huge, 4) for i in range(600)]
    reqs += groups(num_groups=1, prompts_per_group=3)
    sim = ClusterSim(
        ClusterConfig(engines=2, max_concurrency=2), cache_config=CacheConfig(max_total_tokens=4096)
    )
    res = sim.run(reqs)
    assert (res.num_finished, res.num_rejected, res.num_unfinished) == (3, 600, 0)
    with pytest.raises(RuntimeError):
        sim.run(reqs)


def test_table_names_every_run_and_the_ratio() -> None:
    reqs = groups(num_groups=4, prompts_per_group=4)
    results = [
        simulate(reqs, ClusterConfig(engines=2, router=r), label=r)
        for r in ("round_robin", "cache_aware")
    ]
    table = format_table(results)
    assert "round_robin" in table and "cache_aware vs round_robin: throughput x" in table


def test_cli_compares_policies_in_one_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "sim.json"
    argv = [
        "sim",
        "--num-groups", "4", "--prompts-per-group", "4", "--system-prompt-len", "256",
        "--output-len", "4", "--engines", "2", "--router", "round_robin", "cache_aware",
        "--schedule-policy", "lpm", "fcfs", "--json", str(out), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "best achievable hit rate" in text
    for label in ("round_robin/lpm", "round_robin/fcfs", "cache_aware/lpm", "cache_aware/fcfs"):
        assert label in text
    doc = json.loads(out.read_text())
    assert len(doc["results"]) == 4
    assert all(r["num_finished"] == 16 for r in doc["results"])


def test_cli_rejects_a_parameter_the_workload_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "trace", "--num-groups", "3"]) == 2
    assert "--num-groups" in capsys.readouterr().err


def test_every_cache_aware_setting_is_a_flag_of_route_and_sim() -> None:
    # CachePolicyConfig is nested whole into both commands' configs: each of its fields is a
    # flag of `route` and of `sim`, under its own name, and reaches the policy's config.
    import argparse

    from radixserve.config import add_dataclass_args, from_args
    from radixserve.router.policies.config import CachePolicyConfig
    from radixserve.router.proxy.config import RouterConfig

    changed = {"cache_threshold": "0.7", "balance_abs_threshold": "7", "balance_rel_threshold":
               "1.5", "eviction_interval_secs": "3", "max_tree_size": "1000", "share_slack": "inf",
               "cache_aware_scheduling_min_tokens": "9", "warmup_secs": "2"}  # fmt: skip
    assert set(changed) == {f.name for f in dataclasses.fields(CachePolicyConfig)}
    argv = [a for n, v in changed.items() for a in ("--" + n.replace("_", "-"), v)]
    for config in (RouterConfig, ClusterConfig):
        parser = argparse.ArgumentParser()
        add_dataclass_args(parser, config, "x")
        got = from_args(config, parser.parse_args(argv)).cache_policy
        assert got == CachePolicyConfig(0.7, 7, 1.5, 3.0, 1000, float("inf"), 9, 2.0)
        assert from_args(config, parser.parse_args([])).cache_policy == CachePolicyConfig()
