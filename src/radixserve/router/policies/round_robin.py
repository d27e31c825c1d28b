"""`--policy round_robin`: healthy workers in turn. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.router.policies.base import RequestView, RouterPolicy, WorkerView, healthy_indices
from radixserve.router.policies.config import CachePolicyConfig


class RoundRobinPolicy(RouterPolicy):
    """Healthy workers in turn."""

    name = "round_robin"

    def __init__(self, config: CachePolicyConfig | None = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._next = 0

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        healthy = healthy_indices(workers)
        start = self._next % len(workers)
        pick = next((i for i in healthy if i >= start), healthy[0])
        self._next = pick + 1
        return pick
