"""``cpu-contig``: ``cpu-prefix`` whose decodes keep their own contexts contiguous, head-major,
in per-request buffers (``TailBuffers``) that the CPU flash kernel reads in place each step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.model.attention.cpu_prefix import CpuPrefix, add_prefix, flash_cpu
from radixserve.model.attention.plan import DecodeGroup, StepPlan, Tail, build_plan, padded_tails
from radixserve.model.kv_pool import KVPool
from radixserve.sched.batch import BatchEntry


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
                group.slots, group.mask = padded_tails(
                    [decodes[r].slots[group.starts[r] :] for r in short], device, dtype
                )
        return plan

    def _attend_decodes(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, kv: KVPool,
        layer: int,
    ) -> torch.Tensor:  # fmt: skip
        b = group.size
        return _attend_decode_tails(q[:b], k[:b], v[:b], group, kv, layer)


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
        o, lse = flash_cpu(
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
        so, sl = flash_cpu(qg.index_select(0, group.short), sk.transpose(1, 2).to(q.dtype),
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
        add_prefix(out, lse, qg, p.rows, kp, vp)
    return out.to(q.dtype).reshape(b, heads * dim)
