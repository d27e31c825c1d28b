"""What the sampling features cost per decode step on the real model: penalties + min_p +
logit_bias, logprobs with top-5, and a JSON grammar, each against plain sampling of the same
batch in the same run (the baseline). Median step time over the decode steps.

    PYTHONPATH=src python benchmarks/sampling_overhead.py [--batch 8] [--steps 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _machine import machine_line  # noqa: E402
from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.batch import Batch, BatchEntry  # noqa: E402
from radixserve.sched.request import SamplingParams  # noqa: E402

BASE = {"temperature": 0.8, "max_new_tokens": 512, "ignore_eos": True}
CASES = {
    "plain": {},
    "penalties+min_p+bias": {"presence_penalty": 0.5, "frequency_penalty": 0.5,
                             "repetition_penalty": 1.1, "min_p": 0.05,
                             "logit_bias": ((42, 2.0), (7, -100.0))},
    "logprobs top-5": {"return_logprob": True, "top_logprobs_num": 5},
    "json grammar": {"grammar": ("json", "")},
}  # fmt: skip


def run_case(
    runner: TorchRunner, prompts: list[list[int]], sp: SamplingParams, steps: int
) -> list[float]:
    """Seconds of each decode step of the whole batch (prefill excluded)."""
    outs: list[list[int]] = [[] for _ in prompts]
    base, entries = 0, []
    for p in prompts:
        slots = list(range(base, base + len(p) + steps + 1))
        base += len(slots)
        entries.append((p, slots))
    batch = [BatchEntry(f"r{i}", p, 0, s[: len(p)], True, sp, True, 0, p, outs[i])
             for i, (p, s) in enumerate(entries)]  # fmt: skip
    for i, t in enumerate(runner.run(Batch(batch)).next_token_ids):
        outs[i].append(t)
    times = []
    for _ in range(steps):
        step = []
        for i, (p, s) in enumerate(entries):
            n = len(p) + len(outs[i])
            step.append(BatchEntry(f"r{i}", outs[i][-1:], n - 1, s[:n], True, sp, False,
                                   len(outs[i]), p, outs[i]))  # fmt: skip
        t0 = time.perf_counter()
        tokens = runner.run(Batch(step)).next_token_ids
        times.append(time.perf_counter() - t0)
        for i, t in enumerate(tokens):
            outs[i].append(t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="cases interleaved, this many times")
    args = ap.parse_args()
    runner = TorchRunner(ModelConfig(), num_slots=args.batch * (args.steps + 64))
    prompts = [runner.info.encode(f"Request {i}: write a short story about a fox and a dog.")
               for i in range(args.batch)]  # fmt: skip
    print(f"workload: SmolLM2-135M (built-in), {args.batch} requests decoding together, "
          f"{args.steps} steps x {args.rounds} interleaved rounds, temperature 0.8; "
          "median step time")  # fmt: skip
    print(machine_line())
    for sp in CASES.values():  # warm up: first grammar compile, torch kernels
        run_case(runner, prompts, SamplingParams(**BASE, **sp), 2)
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):  # interleaved, so that load from elsewhere hits every case
        for name, extra in CASES.items():
            sp = SamplingParams(**BASE, **extra)
            times[name] += run_case(runner, prompts, sp, args.steps)
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:24s} {t * 1e3:8.2f} ms/step   x{t / base:.2f} of plain")


if __name__ == "__main__":
    main()
