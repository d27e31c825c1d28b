"""A decode step's decoder layers in one call of radixserve's CPU kernels
(``csrc/decode_layers.cpp``) for the dense Llama-family models it takes; ``LlamaModel`` keeps its
op-by-op forward for prefill and for every model or step this does not take."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.model.arch import ModelArch
from radixserve.model.attention.plan import StepPlan
from radixserve.model.kernels import MAX_ROPE_DIM, CpuKernels
from radixserve.model.kv_pool import KVPool


class DecodeLayers:
    """Every layer of a decode-only step in one C call: the weights' addresses laid out once
    in a table (one row per layer), the step's rows, slots and contexts passed per call.
    Why: op by op, SmolLM2-135M's decode step is 240 Python calls and as many OpenMP parallel
    regions; here it is one call and one region (``csrc/decode_layers.cpp``)."""

    def __init__(self, kernels: CpuKernels, arch: ModelArch, layers: Sequence) -> None:
        """``layers``: ``LayerWeights`` whose linears are packed for ``kernels`` (see
        ``build`` for what is taken)."""
        self.kernels = kernels
        self.arch = arch
        self.keep: list[torch.Tensor] = []  # the tensors the table points into
        rows = [self._row(w) for w in layers]
        self.table = torch.tensor(rows, dtype=torch.int64)
        assert self.table.shape[1] == kernels.lib.radixserve_decode_layer_fields()

    @staticmethod
    def build(kernels: CpuKernels | None, arch: ModelArch, layers: Sequence,
              tp_size: int) -> DecodeLayers | None:  # fmt: skip
        """The one-call path for this model, or None where it does not apply: no kernels,
        tensor parallelism (the ranks' all-reduces sit between ops), experts, Qwen3's q/k norms,
        or a shape the kernel does not take."""
        if kernels is None or tp_size != 1 or arch.head_dim % 8 or arch.head_dim > MAX_ROPE_DIM:
            return None
        if arch.intermediate_size % 16:  # gate and up blocks must split at a block boundary
            return None
        for w in layers:
            if w.moe is not None or w.q_norm is not None or w.gate_up is None:
                return None
            if any(lin.ours is None for lin in (w.qkv, w.o, w.gate_up, w.down)):
                return None
            if w.gate_up.bias is not None or w.down.bias is not None:
                return None
        return DecodeLayers(kernels, arch, layers)

    def _ptr(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        t = t.detach().to(torch.float32).contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def _row(self, w) -> list[int]:  # noqa: ANN001 (LayerWeights: llama.py imports this module)
        """One layer's row, in the order of decode_layers.cpp's ``Field``."""
        return [
            self._ptr(w.input_norm), w.qkv.ours.data.data_ptr(), self._ptr(w.qkv.bias),
            w.o.ours.data.data_ptr(), self._ptr(w.o.bias), self._ptr(w.post_norm),
            w.gate_up.ours.data.data_ptr(), w.down.ours.data.data_ptr(),
        ]  # fmt: skip

    @staticmethod
    def accepts(plan: StepPlan, kv: KVPool) -> bool:
        """A step of decodes only, planned by ``cpu-paged`` (whole contexts by slot), over a
        float32 pool."""
        d = plan.decode
        return (
            d is not None
            and d.paged is not None
            and not plan.spans
            and kv.kv.dtype == torch.float32
        )

    def __call__(self, x: torch.Tensor, plan: StepPlan, kv: KVPool, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The last layer's hidden states ``[B, hidden]`` of the embedded rows ``x`` (updated in
        place); writes each row's K/V into ``kv`` at ``plan.write_slots``."""
        a = self.arch
        assert plan.decode is not None and plan.decode.paged is not None
        slots, offsets = plan.decode.paged
        cos = cos.reshape(x.shape[0], -1).contiguous()
        sin = sin.reshape(x.shape[0], -1).contiguous()
        pool = kv.kv
        rc = self.kernels.lib.radixserve_decode_layers_f32(
            x.data_ptr(), x.shape[0], x.shape[1], a.num_layers, self.table.data_ptr(),
            a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, a.rms_norm_eps,
            a.head_dim**-0.5, cos.data_ptr(), sin.data_ptr(), plan.write_slots.data_ptr(),
            pool.data_ptr(), pool.stride(0), pool.stride(1), slots.data_ptr(),
            offsets.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"decode layers kernel: shapes not supported ({a})")
        return x
