"""The Llama-family network (Llama 2/3, SmolLM2, Mistral, Qwen2; Qwen3's per-head q/k norms and
Qwen3-MoE's routed experts) as plain weight tensors and a forward pass over a flattened mixed
batch that reads and writes the slot-indexed KV pool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.model import rope
from radixserve.model.arch import ModelArch, MoEArch
from radixserve.model.attention.base import AttentionBackend
from radixserve.model.attention.plan import StepPlan
from radixserve.model.attention.torch_gather import TorchGather
from radixserve.model.decode_step import DecodeLayers
from radixserve.model.kernels import MAX_ROPE_DIM, CpuKernels, PackedWeight
from radixserve.model.kv_pool import KVPool
from radixserve.model.moe import MoEBlock
from radixserve.model.tp import TPShard, shard_arch


class Linear:
    """``x @ weight.T + bias``. On a CPU in float32 the weight is packed once: for radixserve's
    kernel (``model/kernels.py``: 1.3-1.5x oneDNN at 1-32 rows here) where it builds, else into
    oneDNN's blocked layout, multiplied by oneDNN as vLLM-CPU does (MKL's ``F.linear`` re-reads
    the plain layout every call: oneDNN was up to 2-4x faster at 8-32 rows here, equal at 700).
    The plain weight is then not kept."""

    __slots__ = ("name", "out_features", "weight", "bias", "packed", "kernels", "ours")

    def __init__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None,
                 onednn: bool, kernels: CpuKernels | None = None) -> None:  # fmt: skip
        self.name = name
        self.out_features = weight.shape[0]
        self.bias = bias
        self.kernels = kernels
        self.ours: PackedWeight | None = kernels.pack(weight) if kernels is not None else None
        self.packed = _onednn_pack(weight) if onednn and kernels is None else None
        self.weight = None if onednn or kernels is not None else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours is not None:
            y = self.kernels.linear(x, self.ours)  # type: ignore[union-attr]
            return y if self.bias is None else y.add_(self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused so each is a single matmul. A Qwen3
    layer adds per-head RMSNorms of q and k; a Qwen3-MoE sparse layer has ``moe`` in place of
    ``gate_up`` and ``down``."""

    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None
    down: Linear | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: MoEBlock | None = None


class LlamaModel:
    """Weights plus ``forward``; holds no per-request state (that lives in the KV pool)."""

    def __init__(
        self,
        arch: ModelArch,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend | None = None,
        kv_dtype: torch.dtype | None = None,
        kernels: CpuKernels | None = None,
        tp: TPShard | None = None,
    ) -> None:
        """``kernels``: radixserve's CPU kernels for the linear layers (float32 on a CPU only;
        None: PyTorch's). ``tp``: this rank's shard (``model/tp.py``); ``arch`` is then the
        shape this rank computes (its heads and MLP columns)."""
        self.tp = tp or TPShard()
        self.full_arch = arch
        self.arch = shard_arch(arch, self.tp.size)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.device = device
        self.backend: AttentionBackend = backend or TorchGather()

        def get(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=dtype)

        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        tied = arch.tie_word_embeddings or "lm_head.weight" not in tensors
        self.lm_head = self.embed if tied else get("lm_head.weight")
        onednn = _use_onednn(device, dtype)
        self.kernels = kernels
        if kernels is not None and not (device.type == "cpu" and dtype == torch.float32):
            raise ValueError("radixserve's CPU kernels compute float32 on a CPU only")
        # the LM head (the largest matmul of a decode step) packed once, for our kernel or for
        # oneDNN as vLLM-CPU does (oneDNN: about 2x MKL's F.linear at 8-32 rows on AVX2)
        self.lm_head_linear = (
            Linear("lm_head", self.lm_head, None, onednn, kernels) if self.tp.lm_head else None
        )
        self.layers = [
            _layer(tensors, f"model.layers.{i}.", get, onednn, kernels, self.tp,
                   arch.moe if arch.is_moe_layer(i) else None)
            for i in range(arch.num_layers)
        ]  # fmt: skip
        # a decode-only step's layers in one call of the kernels, where the model allows it
        self.decode_layers = DecodeLayers.build(kernels, self.arch, self.layers, self.tp.size)
        factors = tensors.get("rope_freqs")
        self.inv_freq = rope.inv_freq(arch, factors).to(device)

    def new_kv_pool(self, num_slots: int, scratch: bool = False) -> KVPool:
        a = self.arch
        return KVPool(
            a.num_layers,
            num_slots,
            a.num_kv_heads,
            a.head_dim,
            self.kv_dtype,
            self.device,
            scratch,
        )

    def forward(self, plan: StepPlan, kv: KVPool) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (before the final norm) of the plan's rows; writes the
        rows' K/V into ``kv`` at ``plan.write_slots`` on the way."""
        x = F.embedding(plan.input_ids, self.embed)
        cos, sin = rope.cos_sin(plan.positions, self.inv_freq, self.dtype)
        if self.decode_layers is not None and self.decode_layers.accepts(plan, kv):
            return self.decode_layers(x, plan, kv, cos, sin)
        layer_forward = self._layer_forward
        if self._fused(kv):  # the kernels take cos / sin as [T, head_dim]
            cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
            layer_forward = self._layer_forward_fused
        for i, layer in enumerate(self.layers):
            x = layer_forward(i, layer, x, cos, sin, plan, kv)
        return x

    def _fused(self, kv: KVPool) -> bool:
        """Our kernels for the small ops too: float32 weights and KV, a head dim they take."""
        return (
            self.kernels is not None
            and kv.kv.dtype == torch.float32
            and self.arch.head_dim % 2 == 0
            and self.arch.head_dim <= MAX_ROPE_DIM
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` of hidden rows ``[N, hidden]``."""
        return self._lm_head(self._rms_norm(hidden, self.norm)).float()

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head_linear is None:
            raise RuntimeError(f"tensor-parallel rank {self.tp.rank} computes no logits")
        return self.lm_head_linear(x)

    def _layer_forward(
        self,
        index: int,
        w: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: StepPlan,
        kv: KVPool,
    ) -> torch.Tensor:
        a = self.arch
        rows = x.shape[0]
        qkv = self._qk_norm(w, w.qkv(self._rms_norm(x, w.input_norm)))
        qk_width = (a.num_heads + a.num_kv_heads) * a.head_dim
        # q and k are rotated together: one rope call instead of two
        qk = rope.apply_rope(qkv[:, :qk_width].view(rows, -1, a.head_dim), cos, sin)
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        v = qkv[:, qk_width:].view(rows, a.num_kv_heads, a.head_dim)
        kv.write(index, plan.write_slots, k, v)
        x = x + self.tp.all_reduce(w.o(self.backend.attend(q, k, v, plan, kv, index)))
        h = self._rms_norm(x, w.post_norm)
        return x + self.tp.all_reduce(_mlp(w, h, _silu_mul))

    def _layer_forward_fused(
        self,
        index: int,
        w: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: StepPlan,
        kv: KVPool,
    ) -> torch.Tensor:
        """``_layer_forward`` with the small ops in our kernels (one call each instead of a few
        PyTorch ops): norm; rope of q and k in place with the K/V written to the pool; the
        residual add fused into the second norm; silu(gate) * up. The same arithmetic."""
        a = self.arch
        k = self.kernels
        assert k is not None
        rows = x.shape[0]
        eps = a.rms_norm_eps
        qkv = self._qk_norm(w, w.qkv(k.rms_norm(x, w.input_norm, eps)))
        k.rope_and_cache(qkv, a.num_heads, a.num_kv_heads, a.head_dim, cos, sin,
                         plan.write_slots, kv.kv[index, 0], kv.kv[index, 1])  # fmt: skip
        q_end = a.num_heads * a.head_dim
        k_end = q_end + a.num_kv_heads * a.head_dim
        q = qkv[:, :q_end].view(rows, a.num_heads, a.head_dim)
        kk = qkv[:, q_end:k_end].view(rows, a.num_kv_heads, a.head_dim)
        v = qkv[:, k_end:].view(rows, a.num_kv_heads, a.head_dim)
        attn = self.backend.attend(q, kk, v, plan, kv, index)
        h = k.rms_norm(x, w.post_norm, eps, add=self.tp.all_reduce(w.o(attn)))  # x += o(attn)
        if self.tp.size == 1:  # the residual added inside the down linear
            return _mlp_kernels(w, h, k, residual=x)
        return x.add_(self.tp.all_reduce(_mlp_kernels(w, h, k)))

    def _qk_norm(self, w: LayerWeights, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3's RMSNorm of each q and k head (before rotary), in place in ``qkv``."""
        if w.q_norm is None or w.k_norm is None:
            return qkv
        a = self.arch
        rows, q_end = qkv.shape[0], a.num_heads * a.head_dim
        q = qkv[:, :q_end].view(rows, a.num_heads, a.head_dim)
        k = qkv[:, q_end : q_end + a.num_kv_heads * a.head_dim].view(rows, -1, a.head_dim)
        q.copy_(self._rms_norm(q, w.q_norm))
        k.copy_(self._rms_norm(k, w.k_norm))
        return qkv

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same arithmetic as below
            return F.rms_norm(x, (x.shape[-1],), weight, eps=self.arch.rms_norm_eps)
        # normalised in float32 and cast back before the weight, as transformers does
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.arch.rms_norm_eps)
        return weight * normed.to(x.dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _mlp(
    w: LayerWeights, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The layer's MLP of normed rows ``h``: its experts where it has them, else the dense one."""
    if w.moe is not None:
        return w.moe(h, act)
    assert w.gate_up is not None and w.down is not None
    return w.down(act(w.gate_up(h)))


def _mlp_kernels(
    w: LayerWeights, h: torch.Tensor, k: CpuKernels, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``_mlp`` through our kernels: silu(gate) * up applied inside the gate/up linear where it
    takes the weight (the [T, 2I] gate/up output never written out), else one call after it.
    With ``residual``: ``residual += mlp(h)`` in place (inside the down linear where it can)."""
    gu, down = w.gate_up, w.down
    if w.moe is None and gu is not None and gu.ours is not None and gu.bias is None:
        if k.fuses_silu(gu.ours) and down is not None:
            act = k.linear_silu(h, gu.ours)
            if residual is not None and down.ours is not None and down.bias is None:
                if residual.is_contiguous() and k.adds_in_linear():
                    return k.linear_add(act, down.ours, residual)
            out = down(act)
            return out if residual is None else residual.add_(out)
    out = _mlp(w, h, k.silu_mul)
    return out if residual is None else residual.add_(out)


def _use_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's blocked layout (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


def _layer(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    get: Callable[[str], torch.Tensor],
    onednn: bool = False,
    kernels: CpuKernels | None = None,
    tp: TPShard | None = None,
    moe: MoEArch | None = None,
) -> LayerWeights:
    """One layer's weights, fused, of this rank's shard: q/k/v and gate/up by output rows
    (whole heads, a block of MLP columns), o and down by input columns; o's bias on rank 0 only,
    as the ranks' partial outputs are summed. ``moe``: the layer routes to experts."""
    attn = prefix + "self_attn."
    tp = tp or TPShard()
    cat = _concat(tensors, get, tp)
    proj = [f"{attn}{p}_proj" for p in "qkv"]
    qkv = cat(*(p + ".weight" for p in proj))
    if qkv is None:
        raise KeyError(f"checkpoint lacks attention weights under {prefix!r}")
    o_bias = attn + "o_proj.bias"
    has_qk_norm = attn + "q_norm.weight" in tensors
    mlp = _moe(tensors, prefix, get, onednn, kernels, moe, tp) if moe else None
    gate_up, down = (
        (None, None) if mlp else _dense_mlp(tensors, prefix + "mlp.", get, onednn, kernels, tp)
    )
    return LayerWeights(
        input_norm=get(prefix + "input_layernorm.weight"),
        qkv=Linear("qkv proj", qkv, cat(*(p + ".bias" for p in proj)), onednn, kernels),
        o=Linear("o proj", tp.cols(get(attn + "o_proj.weight")),
                 get(o_bias) if o_bias in tensors and tp.rank == 0 else None, onednn, kernels),
        post_norm=get(prefix + "post_attention_layernorm.weight"),
        gate_up=gate_up, down=down,
        q_norm=get(attn + "q_norm.weight") if has_qk_norm else None,
        k_norm=get(attn + "k_norm.weight") if has_qk_norm else None,
        moe=mlp,
    )  # fmt: skip


def _concat(
    tensors: Mapping[str, torch.Tensor], get: Callable[[str], torch.Tensor], tp: TPShard
) -> Callable[..., torch.Tensor | None]:
    """``cat(*names)``: this rank's rows of the named tensors, stacked; None if one is absent."""

    def cat(*names: str) -> torch.Tensor | None:
        if any(n not in tensors for n in names):
            return None
        return torch.cat([tp.rows(get(n)) for n in names])

    return cat


def _dense_mlp(
    tensors: Mapping[str, torch.Tensor],
    mlp: str,
    get: Callable[[str], torch.Tensor],
    onednn: bool,
    kernels: CpuKernels | None,
    tp: TPShard,
) -> tuple[Linear, Linear]:
    """A SwiGLU MLP's fused gate/up and its down projection, named under ``mlp``."""
    gate_up = _concat(tensors, get, tp)(mlp + "gate_proj.weight", mlp + "up_proj.weight")
    if gate_up is None or mlp + "down_proj.weight" not in tensors:
        raise KeyError(f"checkpoint lacks MLP weights under {mlp!r}")
    down = tp.cols(get(mlp + "down_proj.weight"))
    return Linear("mlp", gate_up, None, onednn, kernels), Linear("mlp", down, None, onednn, kernels)


def _moe(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    get: Callable[[str], torch.Tensor],
    onednn: bool,
    kernels: CpuKernels | None,
    moe: MoEArch,
    tp: TPShard,
) -> MoEBlock:
    """A sparse layer's router and experts (``mlp.gate`` and ``mlp.experts.{e}.*``, as the
    released Qwen3-MoE checkpoints and transformers' ``save_pretrained`` name them)."""
    mlp = prefix + "mlp."
    if mlp + "gate.weight" not in tensors:
        raise KeyError(f"checkpoint lacks the expert router {mlp}gate.weight")
    router = Linear("moe router", get(mlp + "gate.weight"), None, onednn, kernels)
    # each expert split as the dense MLP is (a block of its columns per rank), not whole experts
    # per rank: every rank routes the same rows, so the load is even whatever the router picks,
    # and the layer's one all-reduce sums the experts' partial outputs as it does the dense MLP's
    experts = [
        _dense_mlp(tensors, f"{mlp}experts.{e}.", get, onednn, kernels, tp)
        for e in range(moe.num_experts)
    ]
    return MoEBlock(moe, router, experts)
