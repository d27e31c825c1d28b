"""The per-step plan: a batch's rows (decodes first), the slots each row writes and reads, and
the masks, built once per step on the model's device and read by every layer's attention."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

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
    slots, mask = padded_tails(
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


def padded_tails(
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
