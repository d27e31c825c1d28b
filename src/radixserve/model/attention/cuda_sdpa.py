"""``cuda-sdpa``, the GPU backend: the reference's SDPA calls held to the flash and memory-efficient
kernels; no shared-prefix split (the kernel that returns the log-sum-exp is the CPU's alone)."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from radixserve.model.attention.plan import StepPlan
from radixserve.model.attention.torch_gather import TorchGather
from radixserve.model.kv_pool import KVPool

_CUDA_SDPA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class CudaSdpa(TorchGather):
    """PyTorch SDPA (flash / memory-efficient kernels on a GPU): decodes as in the reference,
    spans in grouped-query mode."""

    name = "cuda-sdpa"
    gqa = True

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, kv: KVPool,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        # not cuDNN's SDPA: it builds an execution plan for every new shape, and decode shapes
        # change every step (measured on an H200 in bfloat16: 1.1 ms of CPU per call, a decode
        # step 4.5x slower than with the flash / memory-efficient kernels)
        with sdpa_kernel(_CUDA_SDPA_KERNELS):
            return super().attend(q, k, v, plan, kv, layer)
