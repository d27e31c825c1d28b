"""Attention over the slot-indexed KV pool for a mixed batch: the per-step plan (row order, slots,
masks) built once from a Batch, and the per-layer attention of the backend chosen at start-up.

Rows are ordered decodes first, so the decode queries are one slice attended in a single padded
SDPA call; every longer span (a prefill chunk) gets its own call with an offset causal mask.

Backends (``--attention-backend``, see ``BACKENDS``):

- ``cpu-prefix``: decodes whose contexts share leading slots (requests on one
  cached prefix) read that prefix's K/V once per group instead of once per request, and merge
  it with their own tail by log-sum-exp (cascade attention); spans use SDPA's grouped-query
  mode, so K/V are never copied per query head.
- ``cuda-sdpa`` (CUDA default): the same SDPA calls without the prefix split (the CPU flash
  kernel that returns the log-sum-exp is CPU-only).
- ``cpu-contig`` (CPU default in bfloat16, or without our kernels): as ``cpu-prefix``, but no
  decode context is gathered per step: each running decode's context (after its shared prefix)
  is kept contiguous and head-major in a buffer of its own, filled from the pool once and
  extended by one token per step, so the flash kernel reads it in place; a shared prefix that
  is one run of slots is read from the pool in place too.
- ``cpu-paged`` (CPU default in float32): decodes through radixserve's C++ kernel
  (``model/kernels.py``), which reads every decode's context from the pool in place by slot, one
  call per layer for all of them; spans as in ``cpu-prefix``.
- ``torch-gather``: the reference: gather every decode's whole context per layer, spans with
  K/V expanded to every query head.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from radixserve.model.kernels import CpuKernels
from radixserve.model.kv_pool import KVPool
from radixserve.sched.batch import BatchEntry

# decodes share a prefix group only when it is at least this long (shorter: not worth a call)
MIN_SHARED_PREFIX = 32


@dataclass(slots=True)
class SharedPrefix:
    """Decode rows ``rows`` whose contexts all start with the slots ``slots``."""

    rows: torch.Tensor  # [m] indices into the decode rows
    slots: torch.Tensor  # [P]
    run: tuple[int, int] | None = None  # (first, end) when ``slots`` are first .. end - 1


@dataclass(slots=True)
class Tail:
    """One decode row's context after its shared prefix, as ``cpu-contig`` reads it this
    step: columns ``lo .. hi - 1`` of ``buf`` ``[layers, 2, kv_heads, capacity, dim]``. Per
    layer the columns from ``fill_col`` are first copied from the pool at ``fill`` (a new or
    rebuilt buffer), and column ``hi - 1`` gets this step's new K/V."""

    buf: torch.Tensor
    lo: int
    hi: int
    fill: torch.Tensor | None = None  # [n] pool slots
    fill_col: int = 0


@dataclass(slots=True)
class DecodeGroup:
    """The first ``size`` rows: one new token each, attending a padded context (with shared
    prefixes: only the part after the row's shared prefix)."""

    size: int
    slots: torch.Tensor  # [B, Lmax] context slots, padded with a valid slot
    mask: torch.Tensor | None  # [B, 1, 1, Lmax] additive; None when all contexts are as long
    prefixes: list[SharedPrefix] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # per row: where its own tail starts
    # cpu-contig: per row its tail buffer, None for a short tail, which is gathered instead
    # (rows ``short``, in ``slots`` / ``mask`` as above)
    tails: list[Tail | None] = field(default_factory=list)
    short: torch.Tensor | None = None
    # cpu-paged: every row's whole context, concatenated ([sum of lengths] pool slots), and
    # where each row's starts ([rows + 1])
    paged: tuple[torch.Tensor, torch.Tensor] | None = None


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
    pad_tails: bool = True,
    paged: bool = False,
) -> StepPlan:
    """Lay a batch's entries out as rows (decodes first) and precompute slots and masks;
    ``share_prefixes`` finds decodes that share leading slots (for ``cpu-prefix``);
    ``pad_tails=False`` leaves the decodes' padded slots and mask out (``cpu-contig``);
    ``paged`` gives the decodes their whole contexts as one slot list instead (``cpu-paged``:
    no padding, no shared prefixes)."""
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
        decode=_paged_group([entries[i] for i in decodes], device)
        if paged
        else _decode_group([entries[i] for i in decodes], device, dtype, share_prefixes, pad_tails),
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
    entries: list[BatchEntry],
    device: torch.device,
    dtype: torch.dtype,
    share: bool = False,
    pad: bool = True,
) -> DecodeGroup | None:
    if not entries:
        return None
    starts, prefixes = _shared_prefixes(entries, device) if share else ([0] * len(entries), [])
    if not pad:
        return DecodeGroup(len(entries), torch.empty(0), None, prefixes, starts)
    slots, mask = _padded_tails(
        [e.slots[s:] for e, s in zip(entries, starts, strict=True)], device, dtype
    )
    return DecodeGroup(len(entries), slots, mask, prefixes, starts)


def _paged_group(entries: list[BatchEntry], device: torch.device) -> DecodeGroup | None:
    if not entries:
        return None
    offsets = [0]
    for e in entries:
        offsets.append(offsets[-1] + e.seq_len)
    flat = torch.tensor(list(chain.from_iterable(e.slots for e in entries)), dtype=torch.int64)
    group = DecodeGroup(len(entries), torch.empty(0), None)
    group.paged = (flat.to(device), torch.tensor(offsets, dtype=torch.int64, device=device))
    return group


def _padded_tails(
    tails: Sequence[Sequence[int]], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Slots ``[B, Lmax]`` of the rows' tails and their additive mask ``[B, 1, 1, Lmax]``
    (None when all are as long)."""
    lens = [len(t) for t in tails]
    width = max(lens)
    # pad with the entry's own first slot so the gather never reads out of range
    padded = [list(t) + [t[0]] * (width - len(t)) for t in tails]
    slots = torch.tensor(padded, dtype=torch.int64, device=device)
    if min(lens) == width:
        return slots, None
    lengths = torch.tensor(lens, device=device)
    valid = torch.arange(width, device=device)[None, :] < lengths[:, None]
    return slots, _additive(valid, dtype)[:, None, None, :]


def _shared_prefixes(
    entries: list[BatchEntry], device: torch.device
) -> tuple[list[int], list[SharedPrefix]]:
    """Per decode row, where its own tail starts; and the groups of rows that share a prefix of
    at least MIN_SHARED_PREFIX slots (every row keeps at least its last slot as its tail)."""
    starts, groups = _prefix_groups(entries, range(len(entries)), lambda e: len(e.slots) - 1)
    prefixes = []
    for rows, shared in groups:
        slots = entries[rows[0]].slots[:shared]
        prefixes.append(
            SharedPrefix(
                torch.tensor(rows, dtype=torch.int64, device=device),
                torch.tensor(slots, dtype=torch.int64, device=device),
                _as_run(slots),
            )
        )
    return starts, prefixes


def _as_run(slots: Sequence[int]) -> tuple[int, int] | None:
    """``(first, end)`` when ``slots`` are ``first, first + 1, .., end - 1``, else None (a run
    is what a prefix prefilled in one step usually gets from the allocator)."""
    first = slots[0]
    end = first + len(slots)
    if slots[-1] != end - 1:
        return None
    if isinstance(slots, array):
        return (first, end) if slots == array(slots.typecode, range(first, end)) else None
    return (first, end) if list(slots) == list(range(first, end)) else None


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
            outs.append(self._attend_decodes(q, k, v, plan.decode, kv, layer))
        if plan.span_prefixes:
            outs.append(_attend_spans_shared(q, k, v, plan, kv, layer))
        else:
            for span in plan.spans:
                outs.append(_attend_span(q, k, v, span, kv, layer, gqa=self.gqa))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(q.shape[0], -1)

    def _attend_decodes(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, kv: KVPool,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        return _attend_decode_shared(q[: group.size], group, kv, layer)


class CpuContig(CpuPrefix):
    """``cpu-prefix`` without the per-step gather of the decodes' contexts: each running decode
    keeps its context after the shared prefix in a contiguous head-major buffer of its own
    (``TailBuffers``), extended by one token per step and read in place by the flash kernel;
    a shared prefix stored as one run of slots is read from the pool in place."""

    name = "cpu-contig"

    def __init__(self) -> None:
        self.tails: TailBuffers | None = None

    def bind(self, kv: KVPool) -> None:
        # the buffers may hold at most half as many tokens as the pool (then: gathers)
        self.tails = TailBuffers(kv, budget_tokens=kv.num_slots // 2)

    def plan(
        self, entries: Sequence[BatchEntry], device: torch.device, dtype: torch.dtype
    ) -> StepPlan:
        if self.tails is None:
            raise RuntimeError("cpu-contig: bind(kv) must be called before the first step")
        plan = build_plan(entries, device, dtype, share_prefixes=True, pad_tails=False)
        group = plan.decode
        if group is not None:  # a prefill-only step keeps the buffers for the next decode
            decodes = [e for e in entries if len(e.token_ids) == 1]
            group.tails = self.tails.update(decodes, group.starts, dtype)
            short = [r for r, t in enumerate(group.tails) if t is None]
            if short:
                group.short = torch.tensor(short, dtype=torch.int64, device=device)
                group.slots, group.mask = _padded_tails(
                    [decodes[r].slots[group.starts[r] :] for r in short], device, dtype
                )
        return plan

    def _attend_decodes(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, kv: KVPool,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        b = group.size
        return _attend_decode_tails(q[:b], k[:b], v[:b], group, kv, layer)


class CpuPaged(CpuPrefix):
    """Decodes through radixserve's C++ kernel (``model/kernels.py``): one call per layer
    reads every decode's context from the pool in place, by slot, with the (row, KV head)
    pairs shared out over the torch threads; no gather, no padding, no per-request buffer.
    Float32 weights and KV only. Prefill spans as in ``cpu-prefix``."""

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


class TailBuffers:
    """The running decodes' contexts (from the start of their own tail), contiguous and
    head-major, one buffer per request: built from the pool once (when a request starts
    decoding, or its tail starts earlier than its buffer), then extended by the token each step
    computes. A buffer is dropped when its request is not among the decodes of a step that has
    decodes (a step of prefills only keeps them all), and reused
    only while the request's slots still match the ones it was built from, so it always holds
    what the pool holds at those slots. Beyond ``budget_tokens`` in all, rows are gathered."""

    CHUNK = 64  # buffers grow by whole chunks of tokens
    # a tail shorter than this is gathered each step: one padded call for all short tails costs
    # less than a call per row (measured: engine_attention.py --contexts 33 --shared-prefix 384)
    MIN_TAIL = 128

    def __init__(self, kv: KVPool, budget_tokens: int) -> None:
        self.layers, _, _, self.kv_heads, self.dim = kv.kv.shape
        self.device = kv.kv.device
        self.budget = budget_tokens
        # rid -> (buffer, context position of column 0, the slots of its columns)
        self.held: dict[str, tuple[torch.Tensor, int, Sequence[int]]] = {}

    @property
    def tokens(self) -> int:
        return sum(buf.shape[3] for buf, _, _ in self.held.values())

    def update(
        self, entries: Sequence[BatchEntry], starts: Sequence[int], dtype: torch.dtype
    ) -> list[Tail | None]:
        """This step's Tail of each decode entry (whose own tail starts at ``starts``); None
        for a tail shorter than ``MIN_TAIL``."""
        old, self.held = self.held, {}
        used = 0
        tails: list[Tail | None] = []
        for e, start in zip(entries, starts, strict=True):
            n = e.seq_len
            if n - start < self.MIN_TAIL:
                tails.append(None)
                continue
            kept = old.get(e.rid)
            if kept is not None:
                buf, base, slots = kept
                if base > start or buf.dtype != dtype or e.slots[base : base + len(slots)] != slots:
                    kept = None
            if kept is None:
                cap = -(-(n - start) // self.CHUNK) * self.CHUNK
                if used + cap > self.budget:  # over budget: this row reads a gathered copy
                    tails.append(self._gathered(e, start, dtype))
                    continue
                shape = (self.layers, 2, self.kv_heads, cap, self.dim)
                buf, base, slots = torch.empty(shape, dtype=dtype, device=self.device), start, []
            filled = len(slots)
            if n - base > buf.shape[3]:  # full: grow by chunks, keeping the filled columns
                cap = -(-(n - base) // self.CHUNK) * self.CHUNK
                grown = buf.new_empty((*buf.shape[:3], cap, self.dim))
                grown[:, :, :, :filled] = buf[:, :, :, :filled]
                buf = grown
            used += buf.shape[3]
            fill = None
            if filled < n - 1 - base:  # columns not held yet, before this step's token
                fill_slots = e.slots[base + filled : n - 1]
                fill = torch.tensor(fill_slots, dtype=torch.int64, device=self.device)
            self.held[e.rid] = (buf, base, e.slots[base:n])
            tails.append(Tail(buf, start - base, n - base, fill, filled))
        return tails

    def _gathered(self, e: BatchEntry, start: int, dtype: torch.dtype) -> Tail:
        """A one-step buffer filled from the pool (every column but this step's token)."""
        n = e.seq_len
        buf = torch.empty((self.layers, 2, self.kv_heads, n - start, self.dim), dtype=dtype,
                          device=self.device)  # fmt: skip
        fill = torch.tensor(e.slots[start : n - 1], dtype=torch.int64, device=self.device)
        return Tail(buf, 0, n - start, fill if fill.numel() else None, 0)


_CUDA_SDPA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
BACKENDS: dict[str, type[TorchGather]] = {
    b.name: b for b in (CpuPaged, CpuContig, CpuPrefix, CudaSdpa, TorchGather)
}
BACKEND_CHOICES = ("auto", *BACKENDS)


def get_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    kernels: CpuKernels | str | None = None,
) -> TorchGather:
    """The backend called ``name`` for a model computing in ``dtype`` with its KV cache in
    ``kv_dtype`` (default: ``dtype``). ``kernels``: radixserve's loaded CPU kernels, or why
    they are not there (a reason, or None: turned off). ``auto``: ``cuda-sdpa`` on a GPU; on a
    CPU ``cpu-paged`` in float32 with the kernels, else ``cpu-contig``. ValueError when the
    backend does not run on ``device``, at these dtypes, or (``cpu-paged``) without the
    kernels."""
    kv_dtype = kv_dtype or dtype
    f32 = dtype == kv_dtype == torch.float32
    if name == "auto":
        if device.type == "cuda":
            name = "cuda-sdpa"
        else:
            name = "cpu-paged" if f32 and isinstance(kernels, CpuKernels) else "cpu-contig"
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (choose from {', '.join(BACKEND_CHOICES)})"
        )
    cls = BACKENDS[name]
    if device.type not in cls.devices:
        raise ValueError(
            f"attention backend {name!r} runs on {' or '.join(cls.devices)}, not on {device.type}"
        )
    if cls is not CpuPaged:
        return cls()
    if not f32:
        raise ValueError(
            f"attention backend 'cpu-paged' computes in float32, not {dtype} weights with a "
            f"{kv_dtype} KV cache (use cpu-contig)"
        )
    if not isinstance(kernels, CpuKernels):
        why = kernels or "needs radixserve's CPU kernels, which are not loaded"
        raise ValueError(f"attention backend 'cpu-paged': {why}")
    return CpuPaged(kernels)


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
        _add_prefix(out, lse, qg, p.rows, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None])
    return out.to(q.dtype).reshape(b, heads * dim)


def _add_prefix(
    out: torch.Tensor, lse: torch.Tensor, qg: torch.Tensor, rows: torch.Tensor,
    kp: torch.Tensor, vp: torch.Tensor,
) -> None:  # fmt: skip
    """Merge into ``out`` (float32 ``[b, kv_heads, per_kv, dim]``, log-sum-exp ``lse``) the
    attention of decode ``rows`` over a prefix they share, ``kp``/``vp`` ``[1, kv_heads, P,
    dim]``: the rows become query rows of one flash call per KV head."""
    _, kv_heads, per_kv, dim = qg.shape
    m = rows.shape[0]
    qm = qg.index_select(0, rows).transpose(0, 1).reshape(1, kv_heads, m * per_kv, dim)
    op, lp = _flash_cpu(qm, kp.to(qg.dtype), vp.to(qg.dtype))
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


def _attend_decode_tails(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, kv: KVPool, layer: int
) -> torch.Tensor:
    """Decodes over their tail buffers (one flash call per row, reading the buffer in place),
    then each shared prefix in one call for its rows (in place when it is one run of slots),
    merged by log-sum-exp."""
    b, heads, dim = q.shape
    kv_heads = kv.kv.shape[3]
    per_kv = heads // kv_heads
    qg = q.view(b, kv_heads, per_kv, dim)
    # this step's K/V as the pool stores them (its dtype), in the buffers' head-major layout
    new = torch.stack((k, v), 1).to(kv.kv.dtype).to(q.dtype)  # [b, 2, kv_heads, dim]
    outs, lses = [], []
    for r, t in enumerate(group.tails):
        if t is None:
            continue
        buf = t.buf[layer]  # [2, kv_heads, capacity, dim]
        if t.fill is not None:
            fk, fv = kv.gather(layer, t.fill)  # [n, kv_heads, dim]
            end = t.fill_col + t.fill.shape[0]
            buf[0, :, t.fill_col : end] = fk.transpose(0, 1)
            buf[1, :, t.fill_col : end] = fv.transpose(0, 1)
        buf[:, :, t.hi - 1] = new[r]
        o, lse = _flash_cpu(
            qg[r : r + 1], buf[0, None, :, t.lo : t.hi], buf[1, None, :, t.lo : t.hi]
        )
        outs.append(o)
        lses.append(lse)
    if group.short is None:
        out, lse = torch.cat(outs), torch.cat(lses)  # [b, kv_heads, per_kv, (dim)]
    else:  # the short tails in one padded call, the others from their buffers
        sk, sv = kv.gather(layer, group.slots)  # [S, Lmax, kv_heads, dim]
        mask = group.mask
        if mask is not None:
            mask = mask.expand(-1, kv_heads, per_kv, -1)
        so, sl = _flash_cpu(qg.index_select(0, group.short), sk.transpose(1, 2).to(q.dtype),
                            sv.transpose(1, 2).to(q.dtype), attn_mask=mask)  # fmt: skip
        if len(outs) == 0:
            out, lse = so, sl
        else:
            long = [r for r, t in enumerate(group.tails) if t is not None]
            at = torch.tensor(long, dtype=torch.int64, device=q.device)
            out = so.new_empty(b, kv_heads, per_kv, dim).index_copy_(0, at, torch.cat(outs))
            out.index_copy_(0, group.short, so)
            lse = sl.new_empty(b, kv_heads, per_kv).index_copy_(0, at, torch.cat(lses))
            lse.index_copy_(0, group.short, sl)
    if not group.prefixes:
        return out.reshape(b, heads * dim)
    out = out.float()
    for p in group.prefixes:
        if p.run is not None:  # the pool's rows in place: [1, kv_heads, P, dim] views
            kp = kv.kv[layer, 0, p.run[0] : p.run[1]].transpose(0, 1)[None]
            vp = kv.kv[layer, 1, p.run[0] : p.run[1]].transpose(0, 1)[None]
        else:
            kp, vp = kv.gather(layer, p.slots)
            kp, vp = kp.transpose(0, 1)[None], vp.transpose(0, 1)[None]
        _add_prefix(out, lse, qg, p.rows, kp, vp)
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
        _merge_lse(out, lse, p.rows, op, lp)
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
