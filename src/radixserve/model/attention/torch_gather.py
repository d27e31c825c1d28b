"""``torch-gather``, the reference backend: every decode's whole context gathered per layer into
one padded SDPA call, each prefill span its own SDPA call with an offset causal mask."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from radixserve.model.attention.plan import DecodeGroup, SpanGroup, StepPlan, build_plan
from radixserve.model.kv_pool import KVPool
from radixserve.sched.batch import BatchEntry


class TorchGather:
    """The reference: every decode's whole context gathered per layer; spans expand K/V to
    every query head."""

    name = "torch-gather"
    gqa = False  # spans in SDPA's grouped-query mode (K/V stay at their KV heads)

    def bind(self, kv: KVPool) -> None:
        """Told the pool it will read (once, before the first step)."""

    def plan(
        self, entries: Sequence[BatchEntry], device: torch.device, dtype: torch.dtype
    ) -> StepPlan:
        return build_plan(entries, device, dtype)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, kv: KVPool,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        """Attention output ``[T, heads * head_dim]`` for queries ``q`` ``[T, heads, dim]``;
        ``k``/``v`` are this step's new keys/values, already written to the pool."""
        outs = []
        if plan.decode is not None:
            outs.append(attend_decode(q[: plan.decode.size], plan.decode, kv, layer))
        for span in plan.spans:
            outs.append(attend_span(q, k, v, span, kv, layer, gqa=self.gqa))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(q.shape[0], -1)


def attend_decode(q: torch.Tensor, group: DecodeGroup, kv: KVPool, layer: int) -> torch.Tensor:
    """One SDPA call for all decodes. The query heads that share a KV head become that head's
    query rows, so grouped-query attention needs no copy of K/V per query head."""
    b, heads, dim = q.shape
    k, v = kv.gather(layer, group.slots)  # [B, L, kv_heads, dim]
    kv_heads = k.shape[2]
    qg = q.view(b, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), attn_mask=group.mask
    )
    return out.reshape(b, heads * dim)


def attend_span(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: SpanGroup,
    kv: KVPool,
    layer: int,
    gqa: bool = False,
) -> torch.Tensor:
    """One span through SDPA; `gqa`: SDPA's grouped-query mode, K/V stay at their KV heads
    (else they are expanded to the query heads first)."""
    rows = slice(span.start, span.end)
    if span.slots is None:
        ctx_k, ctx_v = k[rows], v[rows]
    else:
        ctx_k, ctx_v = kv.gather(layer, span.slots)
    heads = q.shape[1]
    if not gqa:
        ctx_k, ctx_v = _expand_heads(ctx_k, heads), _expand_heads(ctx_v, heads)
    qs = q[rows].transpose(0, 1)[None]  # [1, heads, n, dim]
    ks = ctx_k.to(q.dtype).transpose(0, 1)[None]  # [1, kv_heads (gqa) or heads, L, dim]
    vs = ctx_v.to(q.dtype).transpose(0, 1)[None]
    extra = {"enable_gqa": True} if gqa else {}
    out = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=span.mask, is_causal=span.slots is None, **extra
    )
    return out[0].transpose(0, 1).reshape(span.end - span.start, -1)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[L, kv_heads, dim]`` -> ``[L, heads, dim]``: each KV head serves a run of query heads."""
    length, kv_heads, dim = x.shape
    if kv_heads == heads:
        return x
    group = heads // kv_heads
    return x[:, :, None, :].expand(length, kv_heads, group, dim).reshape(length, heads, dim)
