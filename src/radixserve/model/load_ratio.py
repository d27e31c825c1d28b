"""The engine's start-up load-to-prefill sample: seconds to copy N tokens' KV from host memory
into the device pool and seconds to prefill N tokens, measured once before it serves. It seeds
the running means the engine reports (engine/load_meter.py) in `/get_loads`."""

# Measured on the runner itself, before it serves: one untimed prefill of N tokens (the first
# call pays kernel selection and weight packing: timed, it made the ratio half what it is), then
# one timed, and the faster of two copies (cheap). The prefill is a real forward of N tokens
# into pool slots 0..N-1, the copy a real host -> device scatter of N slots of every layer
# (pinned host memory on a GPU, as HostKVPool keeps it). The slots are zeroed afterwards:
# nothing is cached yet, and the pool must look as the allocator left it.
#
# N = RATIO_TOKENS, Llumnix's --cache-aware-scheduling-min-tokens default: the shortest prompt
# whose prefix a kv_aware router prices at all. The ratio depends on N where the prefill is
# launch-bound: on one H100, random-weight bf16 checkpoints of real shapes, prefill took
# ~12-13 ms flat from 128 to 2,048 tokens while the copy grew with N (ratio 0.007 / 0.022 /
# 0.078 at 128 / 512 / 2,048 tokens for SmolLM2-135M's shape, 0.017 / 0.061 / 0.111 for
# Llama-3.2-1B's); measured at 128 it would understate a 2,000-token load ~5-10x.

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from radixserve.sched.batch import Batch, BatchEntry
from radixserve.sched.request import SamplingParams

RATIO_TOKENS = 1024


def measure_load_ratio(runner: Any, tokens: int = RATIO_TOKENS) -> float | None:
    """Load time over prefill time of ``tokens`` tokens on a TorchRunner (3 significant
    digits); None for a runner without a KV pool (a simulated one) or with no room."""
    return sample_ratio(measure_load_sample(runner, tokens))


def sample_ratio(sample: dict[str, Any] | None) -> float | None:
    """A sample's host load time over its prefill time (3 significant digits; None: none)."""
    if not sample or sample["prefill_s"] <= 0:
        return None
    return float(f"{sample['host_load_s'] / sample['prefill_s']:.3g}")


def measure_load_sample(runner: Any, tokens: int = RATIO_TOKENS) -> dict[str, Any] | None:
    """``{"tokens", "prefill_s", "host_load_s"}``: the best timings of a prefill and of a host
    -> device copy of ``tokens`` tokens (fewer where the pool or the context is shorter) on a
    TorchRunner; None for a runner without a KV pool or with no room."""
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

    greedy = SamplingParams(max_new_tokens=1, temperature=0)
    full = Batch([BatchEntry("load-ratio", ids, 0, list(range(n)), True, greedy, True)])
    try:
        compute = _best(lambda: runner.logits(full), device, 1)
        load = _best(lambda: pool.write_slots(slots, host), device, 2)
    finally:
        pool.kv[:, :, :n].zero_()
    return {"tokens": n, "prefill_s": compute, "host_load_s": load}


def _best(step: Callable[[], object], device: torch.device, runs: int) -> float:
    """The fastest of ``runs`` timings of ``step``, after one untimed run."""
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
