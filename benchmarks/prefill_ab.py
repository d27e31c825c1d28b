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

    python benchmarks/prefill_ab.py --base 0c50320 [--rounds 7]
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

CHUNKS = ((1024, 1024), (576, 1600))  # (queries, context) of a 1,600-token prompt's chunks


def attention_calls(runner: TorchRunner) -> dict[str, tuple]:
    """The prefill attention kernel's two chunk shapes on random queries over the pool."""
    a, k, v = runner.arch, runner.kv.kv[0, 0], runner.kv.kv[0, 1]  # layer 0's pool
    out = {}
    for n, length in CHUNKS:
        q = torch.randn(n, a.num_heads, a.head_dim)
        out[f"attention {n}/{length}"] = (q, k, v, torch.arange(length), a.head_dim**-0.5)
    return out


def one_round(runner: TorchRunner, libs: dict, order: list[str], times: dict) -> None:
    chunks, batch = prefill_chunks(1600, 1024), decode_batch(8, 512, first=1600)
    calls = attention_calls(runner)
    for name in order:
        object.__setattr__(runner.kernels, "lib", libs[name])  # every holder shares the object
        for what, args in calls.items():
            times[(name, what)].append(once(lambda a=args: runner.kernels.prefill_attention(*a)))
        times[(name, "prefill")].append(once(lambda: run_all(runner, chunks)))
        times[(name, "decode step")].append(min(once(lambda: runner.run(batch)) for _ in range(3)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision whose kernels to compare against")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    runner = TorchRunner(ModelConfig(), num_slots=1600 + 8 * 512)
    if runner.kernels is None:
        raise SystemExit("the CPU kernels did not build here")
    runner.kv.kv.normal_()
    print(machine_line())
    print(f"{torch.get_num_threads()} threads, rounds {args.rounds}, base {args.base}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)  # fmt: skip
    times: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_base(args.base, Path(tmp)).lib, "this": runner.kernels.lib}
        whats = [f"attention {n}/{length}" for n, length in CHUNKS] + ["prefill", "decode step"]
        times = {(lib, w): [] for lib in libs for w in whats}
        one_round(runner, libs, ["base", "this"], {k: [] for k in times})  # warm-up
        for r in range(args.rounds):
            one_round(runner, libs, ["base", "this"][:: 1 if r % 2 == 0 else -1], times)
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} (after)")
    fl = prefill_flops(runner, 1, 1600)
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
