"""The engine's load-to-prefill ratio: seconds to copy N tokens' KV from host memory into the
device pool over seconds to prefill N tokens, measured once at start-up. A kv_aware router
prices KV a worker can load (host tier, KV store) at this ratio (`/get_server_info`)."""

# Measured on the runner itself, before it serves: a short warm-up of each (WARM_TOKENS: the
# first call pays kernel selection and weight packing), then one timing of the prefill and the
# faster of two of the copy (cheap). The prefill is a real forward of N tokens into pool slots
# 0..N-1, the copy a real host -> device scatter of N slots of every layer (pinned host memory
# on a GPU, as HostKVPool keeps it). The slots are zeroed afterwards: nothing is cached yet,
# and the pool must look as the allocator left it. Start-up cost: about two prefills of N
# tokens (on this project's 2-core CI machine, built-in model, 0.3-1 s).

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from radixserve.sched.batch import Batch, BatchEntry
from radixserve.sched.request import SamplingParams

RATIO_TOKENS = 128
WARM_TOKENS = 16


def measure_load_ratio(runner: Any, tokens: int = RATIO_TOKENS) -> float | None:
    """Load time over prefill time of ``tokens`` tokens on a TorchRunner (rounded to 4
    digits); None for a runner without a KV pool (a simulated one) or with no room."""
    pool = getattr(runner, "kv", None)
    if pool is None:
        return None
    n = min(tokens, pool.num_slots, runner.info.context_length)
    if n < 2:
        return None
    device = pool.kv.device
    slots = torch.arange(n, dtype=torch.int64, device=device)
    host = pool.read_slots(slots).to("cpu")
    if device.type == "cuda":
        host = host.pin_memory()
    vocab = runner.arch.vocab_size
    ids = [(7 + 31 * i) % vocab for i in range(n)]

    def prefill(k: int) -> Batch:
        greedy = SamplingParams(max_new_tokens=1, temperature=0)
        return Batch([BatchEntry("load-ratio", ids[:k], 0, list(range(k)), True, greedy, True)])

    warm, full = prefill(min(WARM_TOKENS, n)), prefill(n)
    try:
        runner.logits(warm)
        compute = _best(lambda: runner.logits(full), device, 1, warm=False)
        load = _best(lambda: pool.write_slots(slots, host), device, 2)
    finally:
        pool.kv[:, :, :n].zero_()
    return round(load / compute, 4) if compute > 0 else None


def _best(step: Callable[[], object], device: torch.device, runs: int, warm: bool = True) -> float:
    """The fastest of ``runs`` timings of ``step`` (after an untimed run, with ``warm``)."""
    if warm:
        step()
    best = float("inf")
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
