"""`--policy power_of_two`: the less loaded of two random healthy workers. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.router.policies.base import (
    RequestView,
    RouterPolicy,
    WorkerView,
    busyness,
    healthy_indices,
)


class PowerOfTwoPolicy(RouterPolicy):
    """The less loaded of two random healthy workers."""

    name = "power_of_two"

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        healthy = healthy_indices(workers)
        if len(healthy) == 1:
            return healthy[0]
        a, b = self.rng.sample(healthy, 2)
        return min((a, b), key=lambda i: busyness(workers[i]))
