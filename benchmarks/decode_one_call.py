"""A decode step with its layers in one call of the CPU kernels against the op-by-op forward, in
one process, alternated, so both see the same machine load.

SmolLM2-135M (built in, float32, the engine's defaults otherwise), B decodes at the same context
on random KV; per round each path runs ``--steps`` steps after one warm-up; prints the medians of
wall and process CPU time per step, the load average, and the ratio op-by-op / one call. The
logits of the two paths are compared first (they are the same arithmetic).

    python benchmarks/decode_one_call.py [--threads 2] [--rounds 4] [--batch 8] [--context 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _omp import OMP  # first: the engine's OpenMP wait policy, set before torch loads

# isort: split
import torch

from _limits import decode_batch
from _machine import machine_line
from radixserve.config import ModelConfig
from radixserve.model.runner import TorchRunner


def per_step(fn, steps: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``fn`` after one warm-up call."""
    fn()
    out = []
    for _ in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        out.append((time.perf_counter() - w0, time.process_time() - c0))
    return statistics.median(w for w, _ in out) * 1e3, statistics.median(c for _, c in out) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    r = TorchRunner(ModelConfig(num_threads=args.threads), args.batch * args.context + 64)
    r.kv.kv.normal_()
    batch = decode_batch(args.batch, args.context)
    one_call, model = r.model.decode_layers, r.model
    assert one_call is not None, "the one-call path does not apply here (no CPU kernels?)"
    print(machine_line())
    print(f"workload: SmolLM2-135M float32, decode B={args.batch} at context {args.context}, "
          f"{args.threads} threads (OpenMP {OMP}), {args.steps} steps a round")  # fmt: skip
    model.decode_layers = None
    ref = r.logits(batch).clone()
    model.decode_layers = one_call
    print(f"max |logits difference| {(ref - r.logits(batch)).abs().max().item():.2g}")
    ratios = []
    for _ in range(args.rounds):
        times = {}
        for name, path in (("op by op", None), ("one call", one_call)):
            model.decode_layers = path
            times[name] = per_step(lambda: r.run(batch), args.steps)
        ratios.append(times["op by op"][0] / times["one call"][0])
        print("  " + "; ".join(f"{k}: {w:.1f} ms wall, {c:.1f} ms CPU" for k, (w, c) in times.items())
              + f"; load {os.getloadavg()[0]:.1f}; wall ratio {ratios[-1]:.2f}x", flush=True)  # fmt: skip
    print(f"op by op / one call, wall, median of {len(ratios)}: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
