"""Decode attention alone: each CPU attention backend over the same KV pool, per decode step.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64, float32), ``--layers``
layers per step. B requests, each with its own context of L tokens (after ``--shared-prefix`` tokens all share,
default none: the case where ``cpu-prefix`` has nothing to share), prefilled into one run of
slots each; then decode
steps, each appending one token per request (the decodes' slots interleave, as a scheduler
hands them out). A step is the backend's plan plus, per layer, the K/V write and the attention;
the first decode step (where ``cpu-contig`` fills its buffers) is reported apart from the
median of the next ``--steps``. Every backend runs in this process on the same pool, so the
ratios against ``torch-gather`` are same-run.

    python benchmarks/engine_attention.py [--batches 1 8 32] [--contexts 512 2048]
        [--layers 8] [--steps 5] [--backends cpu-paged cpu-contig cpu-prefix torch-gather]
        [--shared-prefix 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _machine import machine_line
from radixserve.config import ModelConfig
from radixserve.model.attention.registry import get_backend
from radixserve.model.kernels import load_cpu_kernels
from radixserve.model.kv_pool import KVPool
from radixserve.sched.batch import BatchEntry
from radixserve.sched.request import SamplingParams

HEADS, KV_HEADS, DIM = 9, 3, 64
CPU = torch.device("cpu")


def run_backend(name: str, b: int, length: int, args: argparse.Namespace) -> tuple[float, float]:
    """(first decode step, median of the next steps), milliseconds."""
    torch.manual_seed(0)
    # a pool 4x what the requests hold, as a server's is larger than its running contexts
    # (cpu-contig's buffers may hold half the pool's tokens)
    num_slots = 4 * (args.shared_prefix + b * (length + args.steps + 2))
    pool = KVPool(args.layers, num_slots, KV_HEADS, DIM, torch.float32, CPU)
    pool.kv.normal_()
    # built where the engine builds them (its --weights-cache-dir default)
    kernels = load_cpu_kernels(ModelConfig().weights_cache_dir) if name == "cpu-paged" else None
    backend = get_backend(name, CPU, kernels=kernels)
    backend.bind(pool)
    shared = list(range(args.shared_prefix))  # one run, at the pool's start
    first = args.shared_prefix
    slots = [shared + list(range(first + i * length, first + (i + 1) * length)) for i in range(b)]
    next_slot = first + b * length
    sampling = SamplingParams(max_new_tokens=args.steps + 2)
    times = []
    for _ in range(args.steps + 1):
        entries = []
        for i in range(b):
            slots[i].append(next_slot)
            next_slot += 1
            entries.append(BatchEntry(f"r{i}", [1], len(slots[i]) - 1, list(slots[i]), True,
                                      sampling, False))  # fmt: skip
        q = torch.randn(b, HEADS, DIM)
        k, v = torch.randn(b, KV_HEADS, DIM), torch.randn(b, KV_HEADS, DIM)
        t0 = time.perf_counter()
        plan = backend.plan(entries, CPU, torch.float32)
        for layer in range(args.layers):
            pool.write(layer, plan.write_slots, k, v)
            backend.attend(q, k, v, plan, pool, layer)
        times.append(time.perf_counter() - t0)
    return times[0] * 1e3, statistics.median(times[1:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--backends", nargs="+", default=["cpu-paged", "cpu-contig", "cpu-prefix", "torch-gather"]
    )
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens every request's context starts with (one run of slots)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)
    print(machine_line())
    print(f"decode attention, {HEADS} heads / {KV_HEADS} KV heads x {DIM}, float32, "
          f"{args.layers} layers per step, {torch.get_num_threads()} torch thread(s), shared prefix "
          f"{args.shared_prefix}; ms per "
          f"step: first decode step / median of the next {args.steps}")  # fmt: skip
    base = args.backends[-1]
    print("| B | L | " + " | ".join(args.backends) + f" | ratio vs {base} (steady) |")
    print("|---" * (len(args.backends) + 3) + "|")
    for b in args.batches:
        for length in args.contexts:
            res = {n: run_backend(n, b, length, args) for n in args.backends}
            cells = [f"{first:.1f} / {steady:.1f}" for first, steady in res.values()]
            ratios = ", ".join(f"{n} {res[n][1] / res[base][1]:.2f}x" for n in args.backends[:-1])
            print(f"| {b} | {length} | " + " | ".join(cells) + f" | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
