"""The engine on this CPU against the machine's own limits, measured in one run.

Each round measures, back to back, the machine's ceilings and the engine, so every ratio is
taken from numbers measured within seconds of each other on a machine whose load swings:

- float32 GEMM: the best rate of ``torch.mm`` over square sizes (2048..4096 by default), with
  the torch thread count the engine uses;
- memory bandwidth, STREAM-like over arrays far larger than the last-level cache: copy
  (``b.copy_(a)``, bytes read plus written) and triad (``a = b + s * c``), best of a few;
- the engine (built-in SmolLM2-135M-Instruct through radixserve's loader, ``TorchRunner`` in
  this process with its defaults: CPU kernels, float32): prefill of one uncached prompt in the
  server's chunks (1,024 tokens on a CPU), as model FLOPs (matmuls, the LM head on the last
  token, causal attention) per second against the GEMM rate; and a decode step at batch B
  (every request at the same context, random KV) against the time to read the weights and
  the batch's KV once at the copy bandwidth.

Prints the workload, the machine (lscpu model, cores, load average before and after) and the
median over rounds of each figure and ratio. ``--profile`` adds torch.profiler's table of a
decode step (ops by self CPU time).

    python benchmarks/cpu_limits.py [--rounds 3] [--prompt-len 1600] [--batch 8] [--context 512]
    python benchmarks/cpu_limits.py --rounds 1 --prompt-len 48 --batch 2 --context 32 \
        --gemm-sizes 256 --stream-mib 8  # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from array import array
from collections.abc import Callable

from _omp import OMP  # first: the engine's OpenMP wait policy, set before torch loads

# isort: split
import torch

from _limits import GREEDY, decode_batch, decode_bound_s, prefill_flops, timed, weight_bytes
from _machine import machine_line
from radixserve.config import ModelConfig
from radixserve.model.runner import TorchRunner
from radixserve.sched.batch import Batch, BatchEntry

CPU = torch.device("cpu")


def lscpu_line() -> str:
    """lscpu's model name, cores and threads per core, and the 1/5/15-minute load average."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        info = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
        info = {k.strip(): v.strip() for k, v in info.items()}
    except (OSError, subprocess.TimeoutExpired):
        info = {}
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"lscpu: {info.get('Model name', '?')}, {info.get('CPU(s)', '?')} cpus, "
            f"{info.get('Thread(s) per core', '?')} thread(s)/core, L3 {info.get('L3 cache', '?')}; "
            f"load average {load}")  # fmt: skip


def best(fn: Callable[[], object], reps: int) -> float:
    """Fastest of ``reps`` timed calls after one warm-up (STREAM's convention)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def gemm_gflops(sizes: list[int], reps: int) -> float:
    """Best float32 ``torch.mm`` rate over the square ``sizes``."""
    rates = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        rates.append(2 * n**3 / best(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), reps) / 1e9)
    return max(rates)


def stream_gbs(mib: int, reps: int) -> tuple[float, float]:
    """Copy and triad bandwidth (GB/s, bytes read plus written) over float32 arrays of ``mib``."""
    n = mib * (1 << 20) // 4
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    copy = 2 * 4 * n / best(lambda: b.copy_(a), reps) / 1e9
    triad = 3 * 4 * n / best(lambda: torch.add(b, c, alpha=3.0, out=a), reps) / 1e9
    return copy, triad


def prefill_chunks(length: int, chunk: int) -> list[Batch]:
    """One uncached prompt of ``length`` tokens as the scheduler runs it: chunks of ``chunk``
    tokens, each over the KV its earlier chunks wrote; only the last one samples."""
    ids = [(7 * j) % 300 + 10 for j in range(length)]
    out = []
    for c0 in range(0, length, chunk):
        c1 = min(length, c0 + chunk)
        entry = BatchEntry("p", ids[c0:c1], c0, array("q", range(c1)), c1 == length, GREEDY, True)
        out.append(Batch([entry]))
    return out


def run_all(runner: TorchRunner, batches: list[Batch]) -> None:
    for b in batches:
        runner.run(b)


def one_round(runner: TorchRunner, args: argparse.Namespace) -> dict:
    gemm = gemm_gflops(args.gemm_sizes, args.gemm_reps)
    copy, triad = stream_gbs(args.stream_mib, args.stream_reps)
    chunks = prefill_chunks(args.prompt_len, args.chunk)
    pre_s = timed(lambda: run_all(runner, chunks), args.prefill_reps, CPU, warmup=0)
    pre_gflops = prefill_flops(runner, 1, args.prompt_len) / pre_s / 1e9
    batch = decode_batch(args.batch, args.context, first=args.prompt_len)
    dec_s = timed(lambda: runner.run(batch), args.decode_reps, CPU, warmup=1)
    bound_s = decode_bound_s(runner, args.batch, args.context, copy * 1e9)
    r = {"gemm_gflops": gemm, "copy_gbs": copy, "triad_gbs": triad, "prefill_s": pre_s,
         "prefill_gflops": pre_gflops, "prefill_of_gemm": pre_gflops / gemm,
         "decode_ms": dec_s * 1e3, "bound_ms": bound_s * 1e3, "decode_over_bound": dec_s / bound_s}  # fmt: skip
    print("  round: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()), flush=True)
    return r


def profile_decode(runner: TorchRunner, args: argparse.Namespace, rows: int = 15) -> None:
    """torch.profiler's ops of a few decode steps by self CPU time (the CPU kernels show as
    their own ops where they are torch ops)."""
    from torch.profiler import ProfilerActivity, profile

    batch = decode_batch(args.batch, args.context, first=args.prompt_len)
    runner.run(batch)
    steps = 5
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.run(batch)
    wall_us = (time.perf_counter() - t0) * 1e6
    ops = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in ops)
    print(f"decode B={args.batch} ctx {args.context}, {steps} steps profiled: {wall_us / 1e3:.0f} ms"
          f" wall, {in_ops / 1e3:.0f} ms in torch ops, {(wall_us - in_ops) / 1e3:.0f} ms outside"
          " them (radixserve's C kernels, Python)")  # fmt: skip
    print(ops.table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=1600)
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk (the server's on a CPU)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512, help="tokens of context per decode")
    p.add_argument("--gemm-sizes", type=int, nargs="+", default=[2048, 3072, 4096])
    p.add_argument("--gemm-reps", type=int, default=3)
    p.add_argument("--stream-mib", type=int, default=256, help="MiB per STREAM array")
    p.add_argument("--stream-reps", type=int, default=5)
    p.add_argument("--prefill-reps", type=int, default=1, help="per round, after one warm-up")
    p.add_argument("--decode-reps", type=int, default=6)
    p.add_argument("--num-threads", type=int, default=0, help="as the engine's --num-threads")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of decode steps")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    print(machine_line())
    print(lscpu_line())
    slots = args.prompt_len + args.batch * args.context
    runner = TorchRunner(ModelConfig(num_threads=args.num_threads), num_slots=slots)
    runner.kv.kv.normal_()
    print(f"workload: SmolLM2-135M {runner.dtype}, {torch.get_num_threads()} torch threads "
          f"(OpenMP {' '.join(f'{k}={v}' for k, v in OMP.items())}); "
          f"prefill 1 x {args.prompt_len} uncached tokens in chunks of {args.chunk} "
          f"({prefill_flops(runner, 1, args.prompt_len) / 1e9:.1f} GFLOP); decode B={args.batch}"
          f" at context {args.context} ({weight_bytes(runner) / 1e6:.0f} MB weights + "
          f"{decode_bound_s(runner, args.batch, args.context, 1.0) / 1e6 - weight_bytes(runner) / 1e6:.0f} MB KV); "
          f"GEMM {args.gemm_sizes} fp32; STREAM arrays {args.stream_mib} MiB; "
          f"{args.rounds} round(s)", flush=True)  # fmt: skip
    run_all(runner, prefill_chunks(args.prompt_len, args.chunk))  # warm-up, once for all rounds
    rounds = [one_round(runner, args) for _ in range(args.rounds)]
    print(lscpu_line().split("; ")[-1] + " (after)")
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(report(med, len(rounds)))
    if args.profile:
        profile_decode(runner, args)


def report(m: dict, n: int) -> str:
    return "\n".join([
        f"medians of {n} round(s):",
        f"  ceilings: fp32 GEMM {m['gemm_gflops']:.1f} GFLOP/s; copy {m['copy_gbs']:.1f} GB/s, "
        f"triad {m['triad_gbs']:.1f} GB/s",
        f"  prefill: {m['prefill_s'] * 1e3:.0f} ms, {m['prefill_gflops']:.1f} GFLOP/s = "
        f"{m['prefill_of_gemm']:.2f}x GEMM ceiling (goal >= 0.9x: "
        f"{'met' if m['prefill_of_gemm'] >= 0.9 else 'not met'})",
        f"  decode: {m['decode_ms']:.1f} ms/step vs bound {m['bound_ms']:.1f} ms = "
        f"{m['decode_over_bound']:.2f}x (goal <= 1.5x: "
        f"{'met' if m['decode_over_bound'] <= 1.5 else 'not met'})",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
