"""Attention over the slot-indexed KV pool for a mixed batch: the per-step plan (row order, slots,
masks) built once from a Batch, and the per-layer attention of the backend chosen at start-up.

Rows are ordered decodes first, so the decode queries are one slice attended in a single padded
SDPA call; every longer span (a prefill chunk) gets its own call with an offset causal mask.

Backends (``--attention-backend``, see ``BACKENDS``):

- ``cpu-prefix`` (CPU default): decodes whose contexts share leading slots (requests on one
  cached prefix) read that prefix's K/V once per group instead of once per request, and merge
  it with their own tail by log-sum-exp (cascade attention); spans use SDPA's grouped-query
  mode, so K/V are never copied per query head.
- ``cuda-sdpa`` (CUDA default): the same SDPA calls without the prefix split (the CPU flash
  kernel that returns the log-sum-exp is CPU-only).
- ``torch-gather``: the reference: gather every decode's whole context per layer, spans with
  K/V expanded to every query head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from radixserve.model.kv_pool import KVPool
from radixserve.sched.batch import BatchEntry

# decodes share a prefix group only when it is at least this long (shorter: not worth a call)
MIN_SHARED_PREFIX = 32


@dataclass(slots=True)
class SharedPrefix:
    """Decode rows ``rows`` whose contexts all start with the slots ``slots``."""

    rows: torch.Tensor  # [m] indices into the decode rows
    slots: torch.Tensor  # [P]


@dataclass(slots=True)
class DecodeGroup:
    """The first ``size`` rows: one new token each, attending a padded context (with shared
    prefixes: only the part after the row's shared prefix)."""

    size: int
    slots: torch.Tensor  # [B, Lmax] context slots, padded with a valid slot
    mask: torch.Tensor | None  # [B, 1, 1, Lmax] additive; None when all contexts are as long
    prefixes: list[SharedPrefix] = field(default_factory=list)


@dataclass(slots=True)
class SpanGroup:
    """Rows ``start .. end - 1``: one entry's new tokens at positions ``start_pos ..``."""

    start: int
    end: int
    slots: torch.Tensor | None  # [L] context slots; None: no cached context (plain causal)
    mask: torch.Tensor | None  # [n, L] additive offset-causal mask when ``slots`` is set
    shared: bool = False  # its context's head is a SharedPrefix of ``StepPlan.span_prefixes``


@dataclass(slots=True)
class StepPlan:
    """Everything a forward step needs besides the weights, on the model's device."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] where each row's K/V is stored
    last_rows: list[int]  # the last row of each entry, indexed like the batch's entries
    decode: DecodeGroup | None
    spans: list[SpanGroup]
    # prefill chunks whose cached contexts start alike: ``rows`` are their query rows counted
    # from the first span row; every query sees the whole prefix
    span_prefixes: list[SharedPrefix] = field(default_factory=list)


def build_plan(
    entries: Sequence[BatchEntry],
    device: torch.device,
    dtype: torch.dtype,
    share_prefixes: bool = False,
) -> StepPlan:
    """Lay a batch's entries out as rows (decodes first) and precompute slots and masks;
    ``share_prefixes`` finds decodes that share leading slots (for ``cpu-prefix``)."""
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

    spans, span_prefixes = _span_groups(
        [entries[i] for i in others], len(decodes), device, dtype, share_prefixes
    )
    return StepPlan(
        input_ids=as_tensor(ids),
        positions=as_tensor(pos),
        write_slots=as_tensor(write),
        last_rows=last_rows,
        decode=_decode_group([entries[i] for i in decodes], device, dtype, share_prefixes),
        spans=spans,
        span_prefixes=span_prefixes,
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
    entries: list[BatchEntry], device: torch.device, dtype: torch.dtype, share: bool = False
) -> DecodeGroup | None:
    if not entries:
        return None
    starts, prefixes = _shared_prefixes(entries, device) if share else ([0] * len(entries), [])
    tails = [e.slots[s:] for e, s in zip(entries, starts, strict=True)]
    lens = [len(t) for t in tails]
    width = max(lens)
    # pad with the entry's own first slot so the gather never reads out of range
    padded = [list(t) + [t[0]] * (width - len(t)) for t in tails]
    slots = torch.tensor(padded, dtype=torch.int64, device=device)
    if min(lens) == width:
        return DecodeGroup(len(entries), slots, None, prefixes)
    lengths = torch.tensor(lens, device=device)
    valid = torch.arange(width, device=device)[None, :] < lengths[:, None]
    return DecodeGroup(len(entries), slots, _additive(valid, dtype)[:, None, None, :], prefixes)


def _shared_prefixes(
    entries: list[BatchEntry], device: torch.device
) -> tuple[list[int], list[SharedPrefix]]:
    """Per decode row, where its own tail starts; and the groups of rows that share a prefix of
    at least MIN_SHARED_PREFIX slots (every row keeps at least its last slot as its tail)."""
    starts, groups = _prefix_groups(entries, range(len(entries)), lambda e: len(e.slots) - 1)
    prefixes = [
        SharedPrefix(
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(entries[rows[0]].slots[:shared], dtype=torch.int64, device=device),
        )
        for rows, shared in groups
    ]
    return starts, prefixes


def _common_length(a: Sequence[int], b: Sequence[int], upto: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``upto`` (binary search over
    slice comparisons, which run in C for lists and arrays)."""
    if a[:upto] == b[:upto]:
        return upto
    lo, hi = 0, upto  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _span_groups(
    entries: list[BatchEntry],
    first_row: int,
    device: torch.device,
    dtype: torch.dtype,
    share: bool = False,
) -> tuple[list[SpanGroup], list[SharedPrefix]]:
    starts = [0] * len(entries)
    groups: list[tuple[list[int], int]] = []
    if share:
        starts, groups = _shared_span_prefixes(entries)
    spans = []
    row = first_row
    for e, skip in zip(entries, starts, strict=True):
        n = len(e.token_ids)
        if e.start_pos == 0:
            spans.append(SpanGroup(row, row + n, None, None))
        else:
            slots = torch.tensor(e.slots[skip:], dtype=torch.int64, device=device)
            query_pos = torch.arange(e.start_pos, e.seq_len, device=device)
            key_pos = torch.arange(skip, e.seq_len, device=device)
            visible = key_pos[None, :] <= query_pos[:, None]
            spans.append(SpanGroup(row, row + n, slots, _additive(visible, dtype), skip > 0))
        row += n
    prefixes = []
    for members, length in groups:
        rows = [r - first_row for i in members for r in range(spans[i].start, spans[i].end)]
        prefixes.append(
            SharedPrefix(
                torch.tensor(rows, dtype=torch.int64, device=device),
                torch.tensor(entries[members[0]].slots[:length], dtype=torch.int64, device=device),
            )
        )
    return spans, prefixes


def _shared_span_prefixes(
    entries: list[BatchEntry],
) -> tuple[list[int], list[tuple[list[int], int]]]:
    """Prefill chunks on a cached context that starts alike: per entry where its own context
    starts, and the groups (entry indices, prefix length); a prefix lies wholly in the cached
    part of every member's context, so all their queries see all of it."""
    candidates = [i for i, e in enumerate(entries) if e.start_pos >= MIN_SHARED_PREFIX]
    return _prefix_groups(entries, candidates, lambda e: e.start_pos)


def _prefix_groups(
    entries: list[BatchEntry], candidates: Iterable[int], limit: Callable[[BatchEntry], int]
) -> tuple[list[int], list[tuple[list[int], int]]]:
    """The candidates grouped by first slot: per entry where its own part starts (0 outside a
    group), and the groups (entry indices, shared length) whose members share at least
    MIN_SHARED_PREFIX slots, at most `limit` of any member."""
    by_first: dict[int, list[int]] = {}
    for i in candidates:
        by_first.setdefault(entries[i].slots[0], []).append(i)
    starts = [0] * len(entries)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        first = entries[members[0]].slots
        shared = min(limit(entries[i]) for i in members)
        for i in members[1:]:
            shared = _common_length(first, entries[i].slots, shared)
        if shared < MIN_SHARED_PREFIX:
            continue
        for i in members:
            starts[i] = shared
        groups.append((members, shared))
    return starts, groups


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.tensor(float("-inf"), dtype=dtype, device=zero.device))


class AttentionBackend(Protocol):
    """Plans a step and computes each layer's attention over the KV pool."""

    name: str

    def plan(
        self, entries: Sequence[BatchEntry], device: torch.device, dtype: torch.dtype
    ) -> StepPlan: ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, kv: KVPool,
        layer: int,
    ) -> torch.Tensor: ...  # fmt: skip


class TorchGather:
    """The reference: every decode's whole context gathered per layer; spans expand K/V to
    every query head."""

    name = "torch-gather"
    devices: tuple[str, ...] = ("cpu", "cuda")
    gqa = False  # spans in SDPA's grouped-query mode (K/V stay at their KV heads)

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
            outs.append(_attend_decode(q[: plan.decode.size], plan.decode, kv, layer))
        for span in plan.spans:
            outs.append(_attend_span(q, k, v, span, kv, layer, gqa=self.gqa))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(q.shape[0], -1)


class CudaSdpa(TorchGather):
    """PyTorch SDPA (flash / memory-efficient kernels on a GPU): decodes as in the reference,
    spans in grouped-query mode."""

    name = "cuda-sdpa"
    devices = ("cuda",)
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


class CpuPrefix(TorchGather):
    """Decodes on a shared prefix read it once per group (cascade attention, merged by
    log-sum-exp from PyTorch's CPU flash-attention kernel); spans in grouped-query mode."""

    name = "cpu-prefix"
    devices = ("cpu",)
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
            outs.append(_attend_decode_shared(q[: plan.decode.size], plan.decode, kv, layer))
        if plan.span_prefixes:
            outs.append(_attend_spans_shared(q, k, v, plan, kv, layer))
        else:
            for span in plan.spans:
                outs.append(_attend_span(q, k, v, span, kv, layer, gqa=self.gqa))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(q.shape[0], -1)


_CUDA_SDPA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
BACKENDS: dict[str, type[TorchGather]] = {b.name: b for b in (CpuPrefix, CudaSdpa, TorchGather)}
BACKEND_CHOICES = ("auto", *BACKENDS)


def get_backend(name: str, device: torch.device) -> TorchGather:
    """The backend called ``name`` (``auto``: the device's default); ValueError when it does
    not run on ``device``."""
    if name == "auto":
        name = "cuda-sdpa" if device.type == "cuda" else "cpu-prefix"
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (choose from {', '.join(BACKEND_CHOICES)})"
        )
    backend = BACKENDS[name]()
    if device.type not in backend.devices:
        raise ValueError(
            f"attention backend {name!r} runs on {' or '.join(backend.devices)}, "
            f"not on {device.type}"
        )
    return backend


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attend_decode(q: torch.Tensor, group: DecodeGroup, kv: KVPool, layer: int) -> torch.Tensor:
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


def _attend_decode_shared(
    q: torch.Tensor, group: DecodeGroup, kv: KVPool, layer: int
) -> torch.Tensor:
    """Decodes with shared prefixes: each row's own tail in one call, each shared prefix in one
    call for all its rows, merged by the two parts' log-sum-exps."""
    if not group.prefixes:
        return _attend_decode(q, group, kv, layer)
    b, heads, dim = q.shape
    k, v = kv.gather(layer, group.slots)
    kv_heads = k.shape[2]
    per_kv = heads // kv_heads
    qg = q.view(b, kv_heads, per_kv, dim)
    mask = group.mask.expand(b, kv_heads, per_kv, -1) if group.mask is not None else None
    out, lse = _flash_cpu(
        qg, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), attn_mask=mask
    )
    out = out.float()
    for p in group.prefixes:
        kp, vp = kv.gather(layer, p.slots)  # [P, kv_heads, dim]
        m = p.rows.shape[0]
        # the group's rows become query rows of one call per KV head: [1, kv_heads, m*per_kv, d]
        qm = qg.index_select(0, p.rows).transpose(0, 1).reshape(1, kv_heads, m * per_kv, dim)
        kp = kp.transpose(0, 1)[None].to(q.dtype)
        vp = vp.transpose(0, 1)[None].to(q.dtype)
        op, lp = _flash_cpu(qm, kp, vp)
        op = op.view(kv_heads, m, per_kv, dim).transpose(0, 1).float()
        lp = lp.view(kv_heads, m, per_kv).transpose(0, 1)
        lt = lse.index_select(0, p.rows)
        total = torch.logaddexp(lp, lt)
        merged = op * (lp - total).exp()[..., None]
        merged += out.index_select(0, p.rows) * (lt - total).exp()[..., None]
        out.index_copy_(0, p.rows, merged)
    return out.to(q.dtype).reshape(b, heads * dim)


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
    out, lse = _flash_cpu(qg, kt, vt, attn_mask=m)
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
            out[rows] = (
                _attend_span(q, k, v, span, kv, layer, gqa=True).view(-1, heads, dim).float()
            )
            continue
        ctx_k, ctx_v = kv.gather(layer, span.slots)
        out[rows], lse[rows] = _flash_grouped(q[span.start : span.end], ctx_k, ctx_v, span.mask)
    queries = q[first:]
    for p in plan.span_prefixes:
        kp, vp = kv.gather(layer, p.slots)
        op, lp = _flash_grouped(queries.index_select(0, p.rows), kp, vp, None)
        lt = lse.index_select(0, p.rows)
        total = torch.logaddexp(lp, lt)
        merged = op * (lp - total).exp()[..., None]
        merged += out.index_select(0, p.rows) * (lt - total).exp()[..., None]
        out.index_copy_(0, p.rows, merged)
    return out.to(q.dtype).reshape(out.shape[0], heads * dim)


def _attend_span(
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
