"""``cpu-prefix``: decodes on one cached prefix read its K/V once per group, merged with their
own tails by log-sum-exp (cascade attention, the CPU flash kernel); spans in grouped-query mode."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.model.attention.plan import DecodeGroup, StepPlan, build_plan
from radixserve.model.attention.torch_gather import TorchGather, attend_decode, attend_span
from radixserve.model.kv_pool import KVPool
from radixserve.sched.batch import BatchEntry

# the CPU flash kernel, which returns the log-sum-exp beside the output (SDPA does not)
flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class CpuPrefix(TorchGather):
    """Decodes on a shared prefix read it once per group (cascade attention, merged by
    log-sum-exp from PyTorch's CPU flash-attention kernel); spans in grouped-query mode."""

    name = "cpu-prefix"
    gqa = True

    def plan(
        self, entries: Sequence[BatchEntry], device: torch.device, dtype: torch.dtype
    ) -> StepPlan:
        return build_plan(entries, device, dtype, share_prefixes=True)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, kv: KVPool,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        outs = []
        if plan.decode is not None:
            outs.append(self._attend_decodes(q, k, v, plan.decode, kv, layer))
        if plan.span_prefixes:
            outs.append(_attend_spans_shared(q, k, v, plan, kv, layer))
        else:
            for span in plan.spans:
                outs.append(attend_span(q, k, v, span, kv, layer, gqa=self.gqa))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(q.shape[0], -1)

    def _attend_decodes(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, kv: KVPool,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        return _attend_decode_shared(q[: group.size], group, kv, layer)


def _attend_decode_shared(
    q: torch.Tensor, group: DecodeGroup, kv: KVPool, layer: int
) -> torch.Tensor:
    """Decodes with shared prefixes: each row's own tail in one call, each shared prefix in one
    call for all its rows, merged by the two parts' log-sum-exps."""
    if not group.prefixes:
        return attend_decode(q, group, kv, layer)
    b, heads, dim = q.shape
    k, v = kv.gather(layer, group.slots)
    kv_heads = k.shape[2]
    per_kv = heads // kv_heads
    qg = q.view(b, kv_heads, per_kv, dim)
    mask = group.mask.expand(b, kv_heads, per_kv, -1) if group.mask is not None else None
    out, lse = flash_cpu(
        qg, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), attn_mask=mask
    )
    out = out.float()
    for p in group.prefixes:
        kp, vp = kv.gather(layer, p.slots)  # [P, kv_heads, dim]
        add_prefix(out, lse, qg, p.rows, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None])
    return out.to(q.dtype).reshape(b, heads * dim)


def add_prefix(
    out: torch.Tensor, lse: torch.Tensor, qg: torch.Tensor, rows: torch.Tensor,
    kp: torch.Tensor, vp: torch.Tensor,
) -> None:  # fmt: skip
    """Merge into ``out`` (float32 ``[b, kv_heads, per_kv, dim]``, log-sum-exp ``lse``) the
    attention of decode ``rows`` over a prefix they share, ``kp``/``vp`` ``[1, kv_heads, P,
    dim]``: the rows become query rows of one flash call per KV head."""
    _, kv_heads, per_kv, dim = qg.shape
    m = rows.shape[0]
    qm = qg.index_select(0, rows).transpose(0, 1).reshape(1, kv_heads, m * per_kv, dim)
    op, lp = flash_cpu(qm, kp.to(qg.dtype), vp.to(qg.dtype))
    op = op.view(kv_heads, m, per_kv, dim).transpose(0, 1).float()
    _merge_lse(out, lse, rows, op, lp.view(kv_heads, m, per_kv).transpose(0, 1))


def _merge_lse(
    out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, op: torch.Tensor, lp: torch.Tensor
) -> None:
    """``out[rows]`` becomes the softmax-weighted sum of itself (log-sum-exp ``lse[rows]``) and
    ``op`` (log-sum-exp ``lp``): two parts of one attention, merged exactly."""
    lt = lse.index_select(0, rows)
    total = torch.logaddexp(lp, lt)
    merged = op * (lp - total).exp()[..., None]
    merged += out.index_select(0, rows) * (lt - total).exp()[..., None]
    out.index_copy_(0, rows, merged)


def _flash_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``[n, heads, dim]`` (float32) and log-sum-exp ``[n, heads]`` of queries ``q``
    ``[n, heads, dim]`` over ``k``/``v`` ``[L, kv_heads, dim]`` (``mask``: ``[n, L]``
    additive); the query heads of one KV head are that head's query rows."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    per_kv = heads // kv_heads
    qg = q.view(n, kv_heads, per_kv, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, dim)
    m = None
    if mask is not None:
        m = mask.repeat(per_kv, 1)[None, None].expand(1, kv_heads, per_kv * n, mask.shape[1])
    kt = k.to(q.dtype).transpose(0, 1)[None]
    vt = v.to(q.dtype).transpose(0, 1)[None]
    out, lse = flash_cpu(qg, kt, vt, attn_mask=m)
    out = out.view(kv_heads, per_kv, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)
    return out.float(), lse.view(kv_heads, per_kv, n).permute(2, 0, 1).reshape(n, heads)


def _attend_spans_shared(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, kv: KVPool, layer: int
) -> torch.Tensor:
    """All spans' rows; a shared span attends its own context here and its group's prefix in
    one call for the whole group, merged by log-sum-exp."""
    first = plan.spans[0].start
    heads, dim = q.shape[1], q.shape[2]
    out = torch.empty(plan.spans[-1].end - first, heads, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(out.shape[0], heads, dtype=torch.float32, device=q.device)
    for span in plan.spans:
        rows = slice(span.start - first, span.end - first)
        if not span.shared:
            out[rows] = attend_span(q, k, v, span, kv, layer, gqa=True).view(-1, heads, dim).float()
            continue
        ctx_k, ctx_v = kv.gather(layer, span.slots)
        out[rows], lse[rows] = _flash_grouped(q[span.start : span.end], ctx_k, ctx_v, span.mask)
    queries = q[first:]
    for p in plan.span_prefixes:
        kp, vp = kv.gather(layer, p.slots)
        op, lp = _flash_grouped(queries.index_select(0, p.rows), kp, vp, None)
        _merge_lse(out, lse, p.rows, op, lp)
    return out.to(q.dtype).reshape(out.shape[0], heads * dim)
