"""Prefill and decode apart in the simulator: xPyD fleets finish every request with every engine's
KV exact, decode engines never compute a prompt token, the KV takes bytes / bandwidth to move,
goodput counts only requests within both SLOs, and a sweep repeats exactly for a seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main
from radixserve.config import CacheConfig
from radixserve.sim.cluster import ClusterConfig, ClusterSim, _Engine
from radixserve.sim.costmodel import get_cost_model
from radixserve.sim.pd import PDClusterSim, PDConfig, simulate_pd
from radixserve.sim.report import SimResult
from radixserve.sim.slo import SloConfig
from radixserve.sim.workloads import SharedPrefixConfig, WorkloadRequest, generated_shared_prefix

TINY = "tiny-cpu"


def groups(
    n: int = 6, per: int = 6, out: int = 24, rate: float = float("inf")
) -> list[WorkloadRequest]:
    cfg = SharedPrefixConfig(
        num_groups=n, prompts_per_group=per, system_prompt_len=600, question_len=80,
        output_len=out, range_ratio=0.5, request_rate=rate,
    )  # fmt: skip
    return generated_shared_prefix(cfg)


class CheckedPD(PDClusterSim):
    """Recounts every engine's KV after each step it starts."""

    def _step(self, eng: _Engine) -> None:
        super()._step(eng)
        eng.sched.check_integrity()


def run_pd(
    reqs: list[WorkloadRequest], split: tuple[int, int], pool: int, **pd: object
) -> tuple[PDClusterSim, SimResult]:
    config = ClusterConfig(engines=sum(split), preset=TINY)
    sim = CheckedPD(config, split, PDConfig(**pd), cache_config=CacheConfig(max_total_tokens=pool))  # type: ignore[arg-type]
    res = sim.run(reqs)
    sim.check_integrity()
    return sim, res


@pytest.mark.parametrize("split", [(1, 3), (2, 2), (3, 1)])
@pytest.mark.parametrize("pool", [24_929, 6_000])  # the preset's pool; one that makes them queue
def test_xpyd_finishes_every_request_with_exact_kv_and_decoders_never_prefill(
    split: tuple[int, int], pool: int
) -> None:
    reqs = groups()
    sim, res = run_pd(reqs, split, pool)
    assert res.num_finished == len(reqs) and res.num_unfinished == 0 == res.num_rejected
    assert res.output_tokens == sum(r.output_len for r in reqs)
    x = split[0]
    computed = res.pd["prefill_tokens_per_engine"]
    assert all(n == 0 for n in computed[x:])  # no decode engine ever ran a prompt token
    assert all(e.steps > 0 for e in res.engines)  # ... yet every engine worked
    assert sum(computed[:x]) == res.prompt_tokens - res.cached_tokens
    assert res.pd["transfers"] == len(reqs)
    for eng in sim.engines:  # everything handed back: free or cached, nothing held or pinned
        kv = eng.sched.kv
        assert kv.allocator.available() + kv.cache.evictable_size() == kv.total
        assert not kv.pins and not eng.sched.receiving and not eng.sched.num_running
    assert not sim._handoffs


def test_a_pool_that_queues_transfers_changes_no_output() -> None:
    """Decode engines short of KV make transfers wait; every request still gets its tokens.
    (A decode engine reserves only what its cache lacks: each keeps the groups' 600-token
    prompts, so 6,000 tokens no longer make anyone wait; 3,000 do.)"""
    reqs = groups()
    _, big = run_pd(reqs, (2, 2), 24_929)
    _, small = run_pd(reqs, (2, 2), 3_000)
    assert small.output_tokens == big.output_tokens
    assert max(small.ttft) > max(big.ttft)  # they did wait for room


def one_request(tokens: int, out: int = 8) -> list[WorkloadRequest]:
    return [WorkloadRequest("r0", 0.0, list(range(1, tokens + 1)), out)]


@pytest.mark.parametrize("tokens", [2_000, 8_000])
def test_transfer_time_is_bytes_over_bandwidth(tokens: int) -> None:
    cost = get_cost_model(TINY)
    ttft = {}
    for gbs in (1.0, 2.0):
        _, res = run_pd(one_request(tokens), (1, 1), 24_929, transfer_bandwidth_gbs=gbs)
        expected = tokens * cost.kv_bytes_per_token_per_gpu / (gbs * 1e9)
        assert res.pd["seconds"] == pytest.approx(expected, rel=1e-9)
        assert res.pd["transfer_bytes"] == tokens * cost.model.kv_bytes_per_token
        ttft[gbs] = res.ttft[0]
    # the same prefill both times: halving the time on the wire is all TTFT gains
    assert ttft[1.0] - ttft[2.0] == pytest.approx(tokens * cost.kv_bytes_per_token_per_gpu / 2e9)


def test_a_long_prompt_stalls_a_decode_when_aggregated_not_when_apart() -> None:
    """A stream decoding 2,000 tokens, then a 16,000-token prompt: on one engine the stream
    waits for the prompt's prefill steps; apart, its decode engine's gaps stay one decode step
    long (TBT is measured the same way in both)."""
    reqs = [
        WorkloadRequest("stream", 0.0, list(range(1, 101)), 2000),
        WorkloadRequest("long", 0.001, list(range(1000, 17000)), 4),
    ]
    cache = CacheConfig(max_total_tokens=24_929)
    together = ClusterSim(ClusterConfig(engines=1, preset=TINY), cache_config=cache).run(reqs)
    apart = simulate_pd(reqs, (1, 1), ClusterConfig(engines=2, preset=TINY), cache_config=cache)
    assert together.num_finished == apart.num_finished == 2
    prefill_chunk = get_cost_model(TINY).step_time([(8192, 0, True)])  # a GPU preset's chunk
    assert max(together.tbt_worst) >= prefill_chunk
    assert max(apart.tbt_worst) < prefill_chunk / 5
    assert together.tbt()["p99"] < prefill_chunk  # one stalled gap in 2,000: not the p99


def test_goodput_counts_only_requests_within_both_bounds() -> None:
    res = SimResult.empty("x", 4, 1)
    res.ttft, res.tbt_worst = [0.1, 0.1, 0.5, 0.5], [0.01, 0.05, 0.01, 0.05]
    res.num_finished, res.first_arrival, res.last_finish = 4, 0.0, 2.0
    assert res.goodput() is None  # no SLO set: no goodput
    res.slo = SloConfig(slo_ttft_ms=200, slo_tbt_ms=20)
    assert res.goodput() == (0.25, 0.5)  # only the first meets both; 1 request in 2 s
    res.slo = SloConfig(slo_ttft_ms=200)
    assert res.goodput() == (0.5, 1.0)
    res.slo = SloConfig(slo_tbt_ms=20)
    assert res.goodput() == (0.5, 1.0)
    res.slo = SloConfig(slo_ttft_ms=500, slo_tbt_ms=50)  # bounds are inclusive
    assert res.goodput() == (1.0, 2.0)


def test_goodput_of_a_run_matches_its_requests_latencies() -> None:
    _, res = run_pd(groups(), (2, 2), 24_929)
    ttft_bound, tbt_bound = sorted(res.ttft)[len(res.ttft) // 2], sorted(res.tbt_worst)[-3]
    res.slo = SloConfig(slo_ttft_ms=ttft_bound * 1e3, slo_tbt_ms=tbt_bound * 1e3)
    both = sum(t <= ttft_bound and w <= tbt_bound for t, w in zip(res.ttft, res.tbt_worst))
    share, rate = res.goodput()  # type: ignore[misc]
    assert 0 < both < len(res.ttft)
    assert share == both / len(res.ttft) and rate == pytest.approx(both / res.duration_s)


def test_a_sweep_repeats_exactly_for_a_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["sim", "--preset", TINY, "--engines", "4", "--pd", "none", "1:3", "2:2",
             "--num-groups", "4", "--prompts-per-group", "6", "--output-len", "16",
             "--request-rate", "300", "--slo-ttft-ms", "20", "--slo-tbt-ms", "1", "--no-progress"]  # fmt: skip
    docs = []
    for i in range(2):
        path = tmp_path / f"run{i}.json"
        assert main([*flags, "--json", str(path)]) == 0
        doc = json.loads(path.read_text())
        for r in doc["results"]:
            r.pop("wall_s"), r.pop("sim_requests_per_min")
        docs.append(doc)
    out = capsys.readouterr().out
    assert docs[0] == docs[1]
    labels = [r["label"] for r in docs[0]["results"]]
    assert labels == ["aggregated", "1P3D", "2P2D"]
    assert "TBT p50/p99 ms" in out and "goodput" in out
    assert "goodput: requests meeting TTFT <= 20 ms and every TBT <= 1 ms" in out
    assert docs[0]["results"][1]["pd"]["decode_engines"] == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pd", "2:3"], "--pd 2:3 has 5 engines, --engines 8"),
        (["--pd", "0:8"], "takes X:Y (prefill and decode engines, each >= 1)"),
        (["--pd", "4:4", "--kv-store-gb", "1"], "--pd runs without lower KV tiers"),
        (["--slo-tbt-ms", "0"], "--slo-tbt-ms must be > 0"),
        (["--transfer-bandwidth-gbs", "10"], "no --pd split was given"),
    ],
)
def test_bad_split_or_slo_is_a_one_line_error(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "--preset", TINY, "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_decode_runs_give_an_xpyd_fleet_the_same_results_as_single_steps() -> None:
    reqs = groups(out=64, rate=2000.0)
    docs = []
    for fast in (True, False):
        config = ClusterConfig(engines=4, preset=TINY, decode_runs=fast)
        sim = PDClusterSim(config, (1, 3), cache_config=CacheConfig(max_total_tokens=8_000))
        res = sim.run(reqs)
        doc = res.to_dict()
        doc.pop("wall_s"), doc.pop("sim_requests_per_min")
        docs.append((doc, res.ttft, res.e2e, res.tbt_worst, res.tbt_hist, sim.run_counts["runs"]))
    assert docs[0][:-1] == docs[1][:-1]
    assert docs[0][-1] > 0 == docs[1][-1]


@pytest.mark.parametrize("split", [(1, 3), (2, 2), (3, 1)])
def test_prefill_pools_full_of_prompts_waiting_for_decode_room_still_drain(
    split: tuple[int, int],
) -> None:
    """1,024 requests at once, 2,048-token system prompts: prefill engines fill their pools
    with prompts waiting to be sent while decode engines are full; neither waits for the
    other for good, and an engine that stopped for want of room starts again."""
    reqs = generated_shared_prefix(SharedPrefixConfig(output_len=64))
    config = ClusterConfig(engines=4, preset=TINY)
    res = simulate_pd(reqs, split, config, cache_config=CacheConfig(max_total_tokens=24_929))
    assert res.num_finished == len(reqs) and res.num_unfinished == 0
