"""The engine's prefill (and a decode step) with this tree's CPU kernels against another
revision's, in one process, alternated.

Builds the kernels' sources at ``--base`` (as ``linear_ab.py`` does) beside this tree's build,
then, in every round and in alternating order, swaps the library under one ``TorchRunner``
(built-in SmolLM2-135M, float32, the engine's defaults) and times: the prefill attention kernel
alone on the two chunks of a 1,600-token prompt (1,024 queries over 1,024 keys, 576 over 1,600;
random queries and pool), one uncached 1,600-token prompt through the runner in 1,024-token
chunks (as ``cpu_limits.py``), and a decode step at batch 8 (context 512). Both libraries see
the same load; prints the medians and this tree's speed over the base's, round by round.
The weights are packed once; the two revisions must share the packed layout.

    python benchmarks/prefill_ab.py --base 0c50320 [--rounds 7] [--threads 1]
    python benchmarks/prefill_ab.py --base HEAD --rounds 1 --prompt-len 40 --chunk 32 \
        --batch 2 --context 16  # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from _omp import OMP  # noqa: F401  first: the engine's OpenMP wait policy, before torch loads

# isort: split
import torch

from _limits import decode_batch, prefill_flops
from _machine import machine_line
from cpu_limits import prefill_chunks, run_all
from linear_ab import build_base, once
from radixserve.config import ModelConfig
from radixserve.model.runner import TorchRunner


def chunk_shapes(prompt_len: int, chunk: int) -> list[tuple[int, int]]:
    """(queries, context) of each chunk of one prompt: (1024, 1024), (576, 1600) by default."""
    return [(min(chunk, prompt_len - c0), min(prompt_len, c0 + chunk))
            for c0 in range(0, prompt_len, chunk)]  # fmt: skip


def attention_calls(runner: TorchRunner, args: argparse.Namespace) -> dict[str, tuple]:
    """The prefill attention kernel on each chunk's shape, random queries over the pool."""
    a, k, v = runner.arch, runner.kv.kv[0, 0], runner.kv.kv[0, 1]  # layer 0's pool
    out = {}
    for n, length in chunk_shapes(args.prompt_len, args.chunk):
        q = torch.randn(n, a.num_heads, a.head_dim)
        out[f"attention {n}/{length}"] = (q, k, v, torch.arange(length), a.head_dim**-0.5)
    return out


def one_round(
    runner: TorchRunner, args: argparse.Namespace, libs: dict, order: list[str], times: dict
) -> None:
    chunks = prefill_chunks(args.prompt_len, args.chunk)
    batch = decode_batch(args.batch, args.context, first=args.prompt_len)
    calls = attention_calls(runner, args)
    for name in order:
        object.__setattr__(runner.kernels, "lib", libs[name])  # every holder shares the object
        for what, call in calls.items():
            times[(name, what)].append(once(lambda a=call: runner.kernels.prefill_attention(*a)))
        times[(name, "prefill")].append(once(lambda: run_all(runner, chunks)))
        times[(name, "decode step")].append(min(once(lambda: runner.run(batch)) for _ in range(3)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision whose kernels to compare against")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--prompt-len", type=int, default=1600)
    p.add_argument("--chunk", type=int, default=1024, help="the server's chunk on a CPU")
    p.add_argument("--batch", type=int, default=8, help="decode step: rows")
    p.add_argument("--context", type=int, default=512, help="decode step: each row's context")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own count)")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    slots = args.prompt_len + args.batch * args.context
    runner = TorchRunner(ModelConfig(), num_slots=slots)
    if args.threads:  # after the runner, which sets its own; 1: steadier where a job holds a core
        torch.set_num_threads(args.threads)
    if runner.kernels is None:
        raise SystemExit("the CPU kernels did not build here")
    runner.kv.kv.normal_()
    print(machine_line())
    print(f"workload: prefill 1 x {args.prompt_len} uncached tokens in chunks of {args.chunk}; "
          f"decode step B={args.batch} at context {args.context}")  # fmt: skip
    print(f"{torch.get_num_threads()} threads, rounds {args.rounds}, base {args.base}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)  # fmt: skip
    times: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_base(args.base, Path(tmp)).lib, "this": runner.kernels.lib}
        shapes = chunk_shapes(args.prompt_len, args.chunk)
        whats = [*(f"attention {n}/{length}" for n, length in shapes), "prefill", "decode step"]
        times = {(lib, w): [] for lib in libs for w in whats}
        one_round(runner, args, libs, ["base", "this"], {k: [] for k in times})  # warm-up
        for r in range(args.rounds):
            one_round(runner, args, libs, ["base", "this"][:: 1 if r % 2 == 0 else -1], times)
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} (after)")
    fl = prefill_flops(runner, 1, args.prompt_len)
    for what in whats:
        base, this = times[("base", what)], times[("this", what)]
        rates = " ".join(f"{b / t:.2f}" for b, t in zip(base, this))
        extra = (
            f", this {fl / statistics.median(this) / 1e9:.1f} GFLOP/s" if what == "prefill" else ""
        )
        print(f"{what}: base {statistics.median(base) * 1e3:.1f} ms, this "
              f"{statistics.median(this) * 1e3:.1f} ms{extra}; speed this/base by round {rates}, "
              f"median {statistics.median(b / t for b, t in zip(base, this)):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
