"""The interface every attention backend implements: the runner and the model call only this,
never asking which backend they got (the registry, ``registry.py``, picks one at start-up)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from radixserve.model.attention.plan import StepPlan
from radixserve.model.kv_pool import KVPool
from radixserve.sched.batch import BatchEntry


class AttentionBackend(Protocol):
    """Plans a step and computes each layer's attention over the KV pool. ``bind`` is called
    once, with the pool, before the first ``plan``."""

    name: str

    def bind(self, kv: KVPool) -> None: ...

    def plan(
        self, entries: Sequence[BatchEntry], device: torch.device, dtype: torch.dtype
    ) -> StepPlan: ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, kv: KVPool,
        layer: int,
    ) -> torch.Tensor: ...  # fmt: skip
