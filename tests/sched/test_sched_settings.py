"""Scheduler.update_settings: the waiting queue's policy, bounded wait and priority settings
change under load with no request lost and every output still right."""

from __future__ import annotations

import random

import pytest

from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.request import ReqState
from radixserve.sched.scheduler import Scheduler
from test_sched_support import Clock, KVRunner, drive, make_req, reference, tokens

SWITCHES = [
    {"schedule_policy": "fcfs"},
    {"schedule_policy": "dfs-weight", "max_wait_ms": 0.0},
    {"max_wait_ms": 5.0},
    {"schedule_policy": "lof", "enable_priority_scheduling": True},
    {"schedule_policy": "priority", "priority_preemption_threshold": 1},
    {"schedule_policy": "lpm", "max_wait_ms": None, "enable_priority_scheduling": False},
]


def _sched(clock: Clock) -> Scheduler:
    cfg = SchedulerConfig(schedule_policy="lpm", max_prefill_tokens=64, chunked_prefill_size=32,
                          max_running_requests=4)  # fmt: skip
    cache = CacheConfig(max_total_tokens=2048)
    return Scheduler(cfg, cache, eos_token_ids=(7,), context_length=4096, clock=clock)


@pytest.mark.parametrize(
    "switch", SWITCHES, ids=lambda s: "+".join(f"{k}={v}" for k, v in s.items())
)
def test_a_switch_under_load_loses_nothing(switch: dict) -> None:
    rng, clock = random.Random(3), Clock()
    shared = tokens(rng, 40)
    reqs = [make_req(f"r{i}", (shared if i % 3 else []) + tokens(rng, 10 + i), 10,
                     priority=i % 3) for i in range(24)]  # fmt: skip
    sched = _sched(clock)
    for r in reqs:
        sched.add_request(r)
    switched = []

    def on_step(s: Scheduler) -> None:
        waiting = sum(r.state is ReqState.WAITING for r in reqs)
        if not switched and waiting > 5:  # mid-run: some running, many waiting
            config = s.update_settings(**switch)
            switched.append(waiting)
            assert all(getattr(config, k) == v for k, v in switch.items())
            assert s.config is config and len(s.policy) == waiting
            s.check_integrity()

    outs = drive(sched, KVRunner(2048), clock=clock, on_step=on_step)
    assert switched, "the switch never happened while requests waited"
    for r in reqs:
        assert outs[r.rid] == reference(r.input_ids, 10, stop=(7,)), r.rid
        assert r.state is ReqState.FINISHED


def test_the_new_order_applies_to_requests_already_waiting() -> None:
    rng, clock = random.Random(5), Clock()
    sched = _sched(clock)
    long_first = [make_req(f"r{i}", tokens(rng, 20), max_new=2 + 10 * (i % 2)) for i in range(8)]
    for r in long_first:
        sched.add_request(r)
    sched.update_settings(schedule_policy="lof")  # longest output first
    order = [rid for rid, _ in sorted(_first_token_steps(sched, clock).items(), key=lambda x: x[1])]
    assert set(order[:4]) == {r.rid for r in long_first if r.sampling.max_new_tokens == 12}


def _first_token_steps(sched: Scheduler, clock: Clock) -> dict[str, int]:
    runner, first, step = KVRunner(2048), {}, 0
    while (batch := sched.step()) is not None:
        step += 1
        for o in sched.on_output(batch, runner.run(batch)):
            first.setdefault(o.rid, step)
        clock.t += 0.01
    return first


def test_bad_settings_change_nothing() -> None:
    sched = _sched(Clock())
    sched.add_request(make_req("a", [1, 2, 3], 4))
    before = (sched.config, sched.policy)
    with pytest.raises(ValueError, match="max_running_requests"):
        sched.update_settings(max_running_requests=9)
    with pytest.raises(ValueError, match="unknown schedule policy"):
        sched.update_settings(schedule_policy="nope")
    with pytest.raises(ValueError, match="max_wait_ms"):
        sched.update_settings(max_wait_ms=-1.0)
    assert (sched.config, sched.policy) == before
    sched.check_integrity()


def _cold_wait(**config: object) -> float:
    """How long one cold request waits while warm ones (sharing a cached prefix) keep arriving
    faster than the one running slot serves them."""
    rng, clock = random.Random(9), Clock()
    cfg = SchedulerConfig(max_running_requests=1, **config)  # type: ignore[arg-type]
    sched = Scheduler(cfg, CacheConfig(max_total_tokens=8192), eos_token_ids=(), clock=clock)
    shared = tokens(rng, 64)
    warm = [(0.02 * i, make_req(f"w{i}", shared + tokens(rng, 4), 6, ignore_eos=True))
            for i in range(150)]  # fmt: skip
    cold = make_req("cold", tokens(rng, 68), 6, ignore_eos=True)
    drive(sched, KVRunner(8192), clock=clock, arrivals=[*warm, (0.05, cold)])
    assert cold.first_scheduled_time is not None and cold.arrival_time is not None
    return cold.first_scheduled_time - cold.arrival_time


def test_bounded_waiting_is_the_default_for_cache_aware_policies() -> None:
    assert SchedulerConfig().max_wait_ms == 1000.0
    assert SchedulerConfig(max_wait_ms=float("inf")).max_wait_ms is None  # --max-wait-ms inf
    unbounded = _cold_wait(max_wait_ms=None)
    for policy in ("lpm", "dfs-weight"):
        assert _cold_wait(schedule_policy=policy) < 1.2 < unbounded
