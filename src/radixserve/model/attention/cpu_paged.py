"""``cpu-paged``: ``cpu-prefix`` whose decodes and prefill chunks go through radixserve's C++
kernels (``model/kernels.py``), which read every context from the pool by slot."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.model.attention.cpu_prefix import CpuPrefix
from radixserve.model.attention.plan import DecodeGroup, StepPlan, build_plan
from radixserve.model.kernels import CpuKernels
from radixserve.model.kv_pool import KVPool
from radixserve.sched.batch import BatchEntry


class CpuPaged(CpuPrefix):
    """Decodes through radixserve's C++ kernel (``model/kernels.py``): one call per layer
    reads every decode's context from the pool in place, by slot, with chunks of the rows' keys
    shared out over the torch threads; no gather, no padding, no per-request buffer.
    Prefill chunks likewise, one call per chunk and layer over its whole context (cached
    part and its own tokens, causal), blocks past a row's position never computed: 1.2-1.9x
    PyTorch's CPU flash kernel on SmolLM2's shapes here (one thread; a 1,024-token chunk, and
    576 tokens over 1,600, where PyTorch computes the whole masked rectangle). Chunks that
    share a cached prefix with another in the step go as in ``cpu-prefix`` (one call per
    shared prefix). Float32 weights and KV only."""

    name = "cpu-paged"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self.scale = 1.0

    def bind(self, kv: KVPool) -> None:
        if kv.kv.dtype != torch.float32:
            raise ValueError(
                f"attention backend 'cpu-paged' computes in float32, not {kv.kv.dtype} "
                "(use cpu-contig)"
            )
        self.scale = kv.kv.shape[4] ** -0.5

    def plan(
        self, entries: Sequence[BatchEntry], device: torch.device, dtype: torch.dtype
    ) -> StepPlan:
        return build_plan(entries, device, dtype, share_prefixes=True, paged=True)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, kv: KVPool,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        if plan.span_prefixes:
            return super().attend(q, k, v, plan, kv, layer)
        outs = []
        if plan.decode is not None:
            outs.append(self._attend_decodes(q, k, v, plan.decode, kv, layer))
        for span in plan.spans:
            slots = plan.write_slots[span.start : span.end] if span.slots is None else span.slots
            outs.append(self.kernels.prefill_attention(
                q[span.start : span.end], kv.kv[layer, 0], kv.kv[layer, 1], slots, self.scale
            ))  # fmt: skip
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_decodes(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, kv: KVPool,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        assert group.paged is not None
        b = group.size
        qd = q[:b].contiguous()
        out = torch.empty_like(qd)
        slots, offsets = group.paged
        self.kernels.decode_attention(
            qd, kv.kv[layer, 0], kv.kv[layer, 1], slots, offsets, self.scale, out
        )
        return out.view(b, -1)
