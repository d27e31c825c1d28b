"""Roofline arithmetic shared by the limits benchmarks (``gpu_limits.py``, ``cpu_limits.py``):
a model's FLOPs for a prefill, the bytes a decode step must read, the batches both time, and
a median timer that synchronises a GPU around each call."""

from __future__ import annotations

import statistics
import time
from array import array
from collections.abc import Callable

import torch

from radixserve.model.kv_pool import KVPool
from radixserve.model.runner import TorchRunner
from radixserve.sched.batch import Batch, BatchEntry
from radixserve.sched.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1 << 20)


def timed(fn: Callable[[], object], reps: int, device: torch.device, warmup: int = 2) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls, synchronised around each call."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def weight_bytes(runner: TorchRunner) -> int:
    """Bytes of every weight a decode step reads (the tied embedding once, as the LM head)."""
    a, size = runner.arch, runner.dtype.itemsize
    hd = a.head_dim
    layer = (
        a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * hd + a.num_heads * hd * a.hidden_size
    )
    layer += 3 * a.hidden_size * a.intermediate_size + 2 * a.hidden_size
    head = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    return (a.num_layers * layer + head + a.hidden_size) * size


def kv_bytes_per_token(runner: TorchRunner) -> int:
    """Bytes of K and V one token of context holds over every layer."""
    a = runner.arch
    return KVPool.bytes_per_slot(a.num_layers, a.num_kv_heads, a.head_dim, runner.kv_dtype)


def decode_bound_s(runner: TorchRunner, batch: int, ctx: int, bytes_per_s: float) -> float:
    """Seconds to read the weights once and ``batch`` contexts of ``ctx`` tokens of KV."""
    return (weight_bytes(runner) + batch * ctx * kv_bytes_per_token(runner)) / bytes_per_s


def decode_batch(b: int, ctx: int, first: int = 0) -> Batch:
    """``b`` decodes, each at position ``ctx - 1`` over ``ctx`` slots of its own."""
    entries = []
    for i in range(b):
        slots = array("q", range(first + i * ctx, first + (i + 1) * ctx))
        entries.append(BatchEntry(f"d{i}", [7 + i % 50], ctx - 1, slots, True, GREEDY, False, 1))
    return Batch(entries)


def prefill_batch(prompts: int, length: int) -> Batch:
    """``prompts`` uncached prompts of ``length`` tokens, each on slots of its own."""
    return Batch([
        BatchEntry(f"p{i}", [(13 * i + 7 * j) % 300 for j in range(length)], 0,
                   array("q", range(i * length, (i + 1) * length)), True, GREEDY, True)
        for i in range(prompts)
    ])  # fmt: skip


def prefill_flops(runner: TorchRunner, prompts: int, length: int) -> float:
    """Matmul FLOPs of ``prompts`` fresh prompts of ``length`` tokens (LM head on each last
    token) plus causal attention (QK^T and PV over the L(L+1)/2 visible pairs)."""
    a = runner.arch
    hd, h = a.head_dim, a.hidden_size
    per_tok = h * (a.num_heads + 2 * a.num_kv_heads) * hd + a.num_heads * hd * h
    per_tok = a.num_layers * (per_tok + 3 * h * a.intermediate_size)
    attn = a.num_layers * 4 * a.num_heads * hd * length * (length + 1) // 2
    return prompts * (2 * per_tok * length + attn + 2 * a.vocab_size * h)
