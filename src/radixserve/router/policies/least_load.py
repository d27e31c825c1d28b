"""`--policy least_load`: the healthy worker with the fewest requests in flight. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.router.policies.base import (
    RequestView,
    RouterPolicy,
    WorkerView,
    busyness,
    healthy_indices,
)


class LeastLoadPolicy(RouterPolicy):
    """The healthy worker with the fewest in-flight requests (then queued tokens, then index)."""

    name = "least_load"

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        return min(healthy_indices(workers), key=lambda i: busyness(workers[i]))
