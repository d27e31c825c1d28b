"""CUDA graphs of decode steps (SGLang's ``--cuda-graph-max-bs`` and ``--disable-cuda-graph``).

A decode-only batch is padded up to a captured bucket and its whole forward, LM head included,
replayed as one graph instead of ~15 kernel launches per layer from Python. SGLang's attention
kernels read each request's context by page table, so it keys its graphs by batch size alone;
this engine's GPU attention gathers each row's context into a padded ``[B, W]`` block, so a
graph is keyed by (batch size, context width) bucket, captured the first time it is needed, and
the padded width costs at most an eighth of the context in extra KV reads.

Everything a step varies lives in one int64 buffer per graph, copied up once per step: token
ids, positions, write slots, each row's start in the flat slot list, and the flat slot list
(the rows' contexts one after another). The padded ``[B, W]`` slots and the mask are computed
from it inside the graph. Padding rows write and read the KV pool's scratch slot only.
"""

from __future__ import annotations

import logging
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.model.attention.plan import DecodeGroup, StepPlan
from radixserve.model.kv_pool import KVPool
from radixserve.model.llama import LlamaModel
from radixserve.model.logprobs import prompt_span
from radixserve.sched.batch import BatchEntry

logger = logging.getLogger(__name__)

# backends whose decode reads ``DecodeGroup.slots`` / ``.mask`` (the padded layout graphs fill)
GRAPH_BACKENDS = ("cuda-sdpa", "torch-gather")
MIN_WIDTH_STEP = 64  # widths are multiples of this at least (SDPA's mask wants aligned rows)


def batch_buckets(max_bs: int) -> list[int]:
    """The captured batch sizes up to ``max_bs``: SGLang's list (1, 2, 4, 8, 12, then every
    multiple of 8), with ``max_bs`` itself last."""
    sizes = [s for s in (1, 2, 4, 8, 12, *range(16, max_bs + 1, 8)) if s <= max_bs]
    return sizes if sizes[-1] == max_bs else [*sizes, max_bs]


def width_bucket(length: int, max_width: int) -> int | None:
    """The padded context width for a longest context of ``length`` tokens: rounded up to a
    multiple of an eighth of the largest power of two not above it (at least MIN_WIDTH_STEP),
    so at most an eighth more above 512; capped at ``max_width``; None when ``length`` exceeds it."""
    if length > max_width:
        return None
    step = max(MIN_WIDTH_STEP, (1 << (max(1, length).bit_length() - 1)) // 8)
    return min(-(-length // step) * step, max_width)


@dataclass(slots=True)
class Captured:
    """One bucket: its step buffer (device int64, laid out as ``DecodeGraphs`` says), and, once
    captured, the graph and the logits ``[batch, vocab]`` it writes."""

    batch: int
    width: int
    meta: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs:
    """Decode steps through per-bucket CUDA graphs. ``capture=False`` runs the same padded,
    static-buffer forward without a graph (a CPU has no graphs; the tests check it there)."""

    def __init__(self, model: LlamaModel, kv: KVPool, max_bs: int, max_width: int,
                 capture: bool = True, max_graphs: int = 64) -> None:  # fmt: skip
        if kv.scratch_slot is None:
            raise ValueError("decode graphs need a KV pool with a scratch slot")
        self.model, self.kv, self.scratch = model, kv, kv.scratch_slot
        self.buckets = batch_buckets(max_bs)
        self.max_width = max_width
        self.capture = capture
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple[int, int], Captured] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def accepts(self, entries: Sequence[BatchEntry]) -> bool:
        """Whether a graph can run this batch: decodes only, each sampling, no prompt logprobs,
        at most the largest bucket, no context wider than ``max_width``."""
        if not entries or len(entries) > self.buckets[-1]:
            return False
        for e in entries:
            if len(e.token_ids) != 1 or not e.sample or prompt_span(e):
                return False
            if e.seq_len > self.max_width:
                return False
        return True

    def logits(self, entries: Sequence[BatchEntry]) -> torch.Tensor:
        """Float32 logits ``[len(entries), vocab]`` of a batch ``accepts`` took (a view of the
        graph's output: read it before the next step)."""
        n = len(entries)
        batch = self.buckets[bisect_left(self.buckets, n)]
        width = width_bucket(max(e.seq_len for e in entries), self.max_width)
        assert width is not None
        g = self._get(batch, width)
        packed = self._pack(entries, batch)
        g.meta[: len(packed)].copy_(torch.frombuffer(packed, dtype=torch.int64))
        if g.graph is None:
            return self._forward(g)[:n]
        g.graph.replay()
        assert g.logits is not None
        return g.logits[:n]

    def _pack(self, entries: Sequence[BatchEntry], batch: int) -> array:
        """The step buffer's used prefix: ids, positions, write slots and row starts of
        ``batch`` rows (padding rows read and write the scratch slot), then the flat slots."""
        pad = batch - len(entries)
        starts = [0]
        for e in entries:
            starts.append(starts[-1] + e.seq_len)
        starts += range(starts[-1] + 1, starts[-1] + 1 + pad)
        out = array("q", [e.token_ids[0] for e in entries] + [0] * pad)
        out.extend([e.start_pos for e in entries] + [0] * pad)
        out.extend([e.slots[e.start_pos] for e in entries] + [self.scratch] * pad)
        out.extend(starts)
        for e in entries:
            out.extend(e.slots if isinstance(e.slots, array) else array("q", e.slots))
        out.extend([self.scratch] * pad)
        return out

    def _get(self, batch: int, width: int) -> Captured:
        key = (batch, width)
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            return g
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        size = 4 * batch + 1 + batch * width
        g = Captured(batch, width, torch.zeros(size, dtype=torch.int64, device=self.kv.kv.device))
        if self.capture:
            self._capture(g)
        self.graphs[key] = g
        return g

    def _capture(self, g: Captured) -> None:
        """Warm the bucket up on a side stream (library handles, autotuning), then capture it,
        every row a padding row so the warm-ups touch only the scratch slot."""
        packed = self._pack([], g.batch)
        g.meta[: len(packed)].copy_(torch.frombuffer(packed, dtype=torch.int64))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(g)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            g.logits = self._forward(g)
        g.graph = graph
        logger.info("captured a decode CUDA graph: batch %d, context width %d", g.batch, g.width)

    def _forward(self, g: Captured) -> torch.Tensor:
        """The decode step over the step buffer of ``g``: nothing here reads the host."""
        b, w, m = g.batch, g.width, g.meta
        starts, ends = m[3 * b : 4 * b], m[3 * b + 1 : 4 * b + 1]
        flat = m[4 * b + 1 :]
        cols = torch.arange(w, device=m.device)
        valid = cols[None, :] < (ends - starts)[:, None]
        index = torch.where(valid, starts[:, None] + cols[None, :], starts[:, None])
        mask = torch.zeros(b, w, dtype=self.model.dtype, device=m.device)
        mask.masked_fill_(~valid, float("-inf"))
        plan = StepPlan(
            input_ids=m[:b], positions=m[b : 2 * b], write_slots=m[2 * b : 3 * b],
            last_rows=list(range(b)), decode=DecodeGroup(b, flat[index], mask[:, None, None, :]),
            spans=[],
        )  # fmt: skip
        return self.model.logits(self.model.forward(plan, self.kv))
