"""Attention over the slot-indexed KV pool for a mixed batch: the per-step plan (row order, slots,
masks) built once from a Batch, and the per-layer attention that follows it.

Rows are ordered decodes first, so the decode queries are one slice attended in a single padded
SDPA call; every longer span (a prefill chunk) gets its own call with an offset causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.model.kv_pool import KVPool
from radixserve.sched.batch import BatchEntry


@dataclass(slots=True)
class DecodeGroup:
    """The first ``size`` rows: one new token each, attending a padded context."""

    size: int
    slots: torch.Tensor  # [B, Lmax] context slots, padded with a valid slot
    mask: torch.Tensor | None  # [B, 1, 1, Lmax] additive; None when all contexts are as long


@dataclass(slots=True)
class SpanGroup:
    """Rows ``start .. end - 1``: one entry's new tokens at positions ``start_pos ..``."""

    start: int
    end: int
    slots: torch.Tensor | None  # [L] context slots; None: no cached context (plain causal)
    mask: torch.Tensor | None  # [n, L] additive offset-causal mask when ``slots`` is set


@dataclass(slots=True)
class StepPlan:
    """Everything a forward step needs besides the weights, on the model's device."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] where each row's K/V is stored
    last_rows: list[int]  # the last row of each entry, indexed like the batch's entries
    decode: DecodeGroup | None
    spans: list[SpanGroup]


def build_plan(entries: Sequence[BatchEntry], device: torch.device, dtype: torch.dtype) -> StepPlan:
    """Lay a batch's entries out as rows (decodes first) and precompute slots and masks."""
    for e in entries:
        _check_entry(e)
    decodes = [i for i, e in enumerate(entries) if len(e.token_ids) == 1]
    others = [i for i, e in enumerate(entries) if len(e.token_ids) > 1]
    order = decodes + others
    ids: list[int] = []
    pos: list[int] = []
    write: list[int] = []
    last_rows = [0] * len(entries)
    for i in order:
        e = entries[i]
        ids += e.token_ids
        pos += range(e.start_pos, e.seq_len)
        write += e.slots[e.start_pos :]
        last_rows[i] = len(ids) - 1

    def as_tensor(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=device)

    return StepPlan(
        input_ids=as_tensor(ids),
        positions=as_tensor(pos),
        write_slots=as_tensor(write),
        last_rows=last_rows,
        decode=_decode_group([entries[i] for i in decodes], device, dtype),
        spans=_span_groups([entries[i] for i in others], len(decodes), device, dtype),
    )


def _check_entry(e: BatchEntry) -> None:
    if not e.token_ids:
        raise ValueError(f"request {e.rid}: a batch entry needs at least one token")
    if len(e.slots) != e.seq_len:
        raise ValueError(
            f"request {e.rid}: {len(e.slots)} slots for {e.seq_len} positions "
            f"(start_pos {e.start_pos} + {len(e.token_ids)} tokens)"
        )


def _decode_group(
    entries: list[BatchEntry], device: torch.device, dtype: torch.dtype
) -> DecodeGroup | None:
    if not entries:
        return None
    lens = [e.seq_len for e in entries]
    width = max(lens)
    # pad with the entry's own first slot so the gather never reads out of range
    padded = [list(e.slots) + [e.slots[0]] * (width - len(e.slots)) for e in entries]
    slots = torch.tensor(padded, dtype=torch.int64, device=device)
    if min(lens) == width:
        return DecodeGroup(len(entries), slots, None)
    lengths = torch.tensor(lens, device=device)
    valid = torch.arange(width, device=device)[None, :] < lengths[:, None]
    return DecodeGroup(len(entries), slots, _additive(valid, dtype)[:, None, None, :])


def _span_groups(
    entries: list[BatchEntry], first_row: int, device: torch.device, dtype: torch.dtype
) -> list[SpanGroup]:
    spans = []
    row = first_row
    for e in entries:
        n = len(e.token_ids)
        if e.start_pos == 0:
            spans.append(SpanGroup(row, row + n, None, None))
        else:
            slots = torch.tensor(e.slots, dtype=torch.int64, device=device)
            query_pos = torch.arange(e.start_pos, e.seq_len, device=device)
            visible = torch.arange(e.seq_len, device=device)[None, :] <= query_pos[:, None]
            spans.append(SpanGroup(row, row + n, slots, _additive(visible, dtype)))
        row += n
    return spans


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.tensor(float("-inf"), dtype=dtype, device=zero.device))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, kv: KVPool, layer: int
) -> torch.Tensor:
    """Attention output ``[T, heads * head_dim]`` for queries ``q`` ``[T, heads, dim]``.

    ``k``/``v`` are this step's new keys/values, already written to the pool.
    """
    outs = []
    if plan.decode is not None:
        outs.append(_attend_decode(q[: plan.decode.size], plan.decode, kv, layer))
    for span in plan.spans:
        outs.append(_attend_span(q, k, v, span, kv, layer))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(q.shape[0], -1)


def _attend_decode(q: torch.Tensor, group: DecodeGroup, kv: KVPool, layer: int) -> torch.Tensor:
    """One SDPA call for all decodes. The query heads that share a KV head become that head's
    query rows, so grouped-query attention needs no copy of K/V per query head."""
    b, heads, dim = q.shape
    k, v = kv.gather(layer, group.slots)  # [B, L, kv_heads, dim]
    kv_heads = k.shape[2]
    qg = q.view(b, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask
    )
    return out.reshape(b, heads * dim)


def _attend_span(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: SpanGroup,
    kv: KVPool,
    layer: int,
) -> torch.Tensor:
    rows = slice(span.start, span.end)
    if span.slots is None:
        ctx_k, ctx_v = k[rows], v[rows]
    else:
        ctx_k, ctx_v = kv.gather(layer, span.slots)
    heads = q.shape[1]
    qs = q[rows].transpose(0, 1)[None]  # [1, heads, n, dim]
    ks = _expand_heads(ctx_k, heads).transpose(0, 1)[None]
    vs = _expand_heads(ctx_v, heads).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=span.mask, is_causal=span.slots is None
    )
    return out[0].transpose(0, 1).reshape(span.end - span.start, -1)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[L, kv_heads, dim]`` -> ``[L, heads, dim]``: each KV head serves a run of query heads."""
    length, kv_heads, dim = x.shape
    if kv_heads == heads:
        return x
    group = heads // kv_heads
    return x[:, :, None, :].expand(length, kv_heads, group, dim).reshape(length, heads, dim)
