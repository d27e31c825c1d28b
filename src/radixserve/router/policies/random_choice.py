"""`--policy random`: a uniformly random healthy worker. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.router.policies.base import RequestView, RouterPolicy, WorkerView, healthy_indices


class RandomPolicy(RouterPolicy):
    """A uniformly random healthy worker (seeded, so runs repeat)."""

    name = "random"

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        return self.rng.choice(healthy_indices(workers))
