"""What the playground computes, all through the discrete-event simulator (the real Scheduler and
RadixCache on one simulated engine): the policy comparison, the two sweeps and the 6-request trace."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.playground.params import Params
from radixserve.sim.cluster import ClusterConfig, simulate
from radixserve.sim.report import SimResult, summarize
from radixserve.sim.workloads import PrefixMixConfig, WorkloadRequest, prefix_mix

# one engine: with a single worker the router policy never matters, so take the cheapest
CLUSTER = ClusterConfig(engines=1, router="round_robin")
CURVE_PROBS = (0.0, 0.25, 0.5, 0.75, 1.0)
CURVE_POLICIES = ("fcfs", "lpm")
WAIT_SWEEP_MS: tuple[float | None, ...] = (0, 10, 30, 100, 300, 1000, None)


def workload(p: Params) -> list[WorkloadRequest]:
    """The request stream of ``p``: `radixserve sim --workload shared-prefix-mix` with the same
    values makes the same one."""
    fields = {f.name for f in dataclasses.fields(PrefixMixConfig)}
    kw = {k: v for k, v in dataclasses.asdict(p).items() if k in fields}
    return prefix_mix(PrefixMixConfig(**kw))


def configs(
    p: Params, policy: str, max_wait_ms: float | None
) -> tuple[SchedulerConfig, CacheConfig]:
    sched = SchedulerConfig(
        schedule_policy=policy,
        max_wait_ms=max_wait_ms,
        max_running_requests=p.max_running_requests,
    )
    return sched, CacheConfig(max_total_tokens=p.kv_tokens)


def run(
    p: Params, reqs: list[WorkloadRequest], policy: str, max_wait_ms: float | None
) -> SimResult:
    sched, cache = configs(p, policy, max_wait_ms)
    return simulate(reqs, CLUSTER, sched, cache, label=policy)


def summary(res: SimResult) -> dict[str, Any]:
    """The numbers a view shows of one run (waits in seconds: first scheduled - arrival)."""
    wait = summarize(res.wait)
    return {
        "policy": res.label,
        "hit_rate": res.hit_rate,
        "wait_mean_s": wait["mean"],
        "wait_p99_s": wait["p99"],
        "output_throughput": res.output_throughput,
        "finished": res.num_finished,
        "rejected": res.num_rejected,
        "requests": res.num_requests,
    }


def compare(p: Params) -> list[dict[str, Any]]:
    """Each chosen policy on the same stream, under the same fairness bound."""
    reqs = workload(p)
    return [summary(run(p, reqs, policy, p.max_wait_ms)) for policy in p.policies]


def curve(p: Params) -> Iterator[dict[str, Any]]:
    """Hit rate against the shared-prefix probability, for FCFS and LPM, one point at a time."""
    for prob in CURVE_PROBS:
        q = dataclasses.replace(p, shared_prob=prob)
        reqs = workload(q)
        for policy in CURVE_POLICIES:
            yield {"shared_prob": prob, **summary(run(q, reqs, policy, q.max_wait_ms))}


def tradeoff(p: Params) -> Iterator[dict[str, Any]]:
    """Hit rate against p99 wait as the fairness bound of ``sweep_policy`` goes from 0 (arrival
    order) to unbounded (pure cache order), one bound at a time."""
    reqs = workload(p)
    for wait in WAIT_SWEEP_MS:
        yield {"max_wait_ms": wait, **summary(run(p, reqs, p.sweep_policy, wait))}


def total_points(view: str) -> int:
    return len(CURVE_PROBS) * len(CURVE_POLICIES) if view == "curve" else len(WAIT_SWEEP_MS)
