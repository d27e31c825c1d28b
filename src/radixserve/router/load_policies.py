"""The policies that look at load alone: round_robin, random, power_of_two, least_load. They
register themselves in policies.POLICIES on import (policies.py imports this module)."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.router.policies import (
    CachePolicyConfig,
    RequestView,
    RouterPolicy,
    WorkerView,
    healthy_indices,
    register,
)


def _busyness(worker: WorkerView) -> tuple[int, int]:
    return (worker.load, worker.queued_tokens)


@register("round_robin")
class RoundRobinPolicy(RouterPolicy):
    """Healthy workers in turn."""

    def __init__(self, config: CachePolicyConfig | None = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._next = 0

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        healthy = healthy_indices(workers)
        start = self._next % len(workers)
        pick = next((i for i in healthy if i >= start), healthy[0])
        self._next = pick + 1
        return pick


@register("random")
class RandomPolicy(RouterPolicy):
    """A uniformly random healthy worker (seeded, so runs repeat)."""

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        return self.rng.choice(healthy_indices(workers))


@register("power_of_two")
class PowerOfTwoPolicy(RouterPolicy):
    """The less loaded of two random healthy workers."""

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        healthy = healthy_indices(workers)
        if len(healthy) == 1:
            return healthy[0]
        a, b = self.rng.sample(healthy, 2)
        return min((a, b), key=lambda i: _busyness(workers[i]))


@register("least_load")
class LeastLoadPolicy(RouterPolicy):
    """The healthy worker with the fewest in-flight requests (then queued tokens, then index)."""

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        return min(healthy_indices(workers), key=lambda i: _busyness(workers[i]))
