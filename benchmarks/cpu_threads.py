"""The engine's thread settings compared paired: torch thread count and libgomp's wait policy.

Each variant (a thread count and OpenMP environment variables, which libgomp reads once, when
torch loads it) runs in a worker process of its own, holding the built-in SmolLM2-135M-Instruct
through radixserve's ``TorchRunner`` (its defaults otherwise: CPU kernels, float32). The driver
then interleaves them: each round, every variant in turn (a rotated order) times ``--steps``
decode steps at batch ``--batch`` (context ``--context``, random KV) and one prefill chunk of
``--prefill-len`` uncached tokens. Ratios are against the first variant, taken within a round
and reported as medians over rounds, so the machine's swings cancel out.

``--busy N`` starts N processes that spin in Python for the whole run: neighbours that hold
the cores, reproducibly (a shared CI runner, other jobs on a workstation). ``--busy 0`` measures
the machine as it is (say how busy it was: the load average is printed).

    python benchmarks/cpu_threads.py [--busy 0] [--rounds 5] [--variants "spin:2:GOMP_SPINCOUNT=300000" ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VARIANTS = [
    "spin:2:GOMP_SPINCOUNT=300000",  # libgomp's own default (spin 300k iterations, then sleep)
    "passive:2:OMP_WAIT_POLICY=PASSIVE",
    "spin10k:2:GOMP_SPINCOUNT=10000",
    "1thread:1:OMP_WAIT_POLICY=PASSIVE",
]
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def parse_variant(text: str) -> tuple[str, int, dict[str, str]]:
    """``label:threads[:VAR=VALUE,VAR=VALUE]``."""
    label, threads, *rest = text.split(":", 2)
    env = dict(kv.split("=", 1) for kv in rest[0].split(",") if kv) if rest else {}
    return label, int(threads), env


def worker(threads: int, batch: int, context: int, prefill_len: int) -> None:
    """Serve timing commands on stdin ('decode N' / 'prefill'), one JSON line each on stdout."""
    import torch

    from _limits import decode_batch, prefill_batch
    from radixserve.config import ModelConfig
    from radixserve.model.runner import TorchRunner

    torch.set_grad_enabled(False)
    runner = TorchRunner(ModelConfig(num_threads=threads), num_slots=prefill_len + batch * context)
    runner.kv.kv.normal_()
    dec = decode_batch(batch, context, first=prefill_len)
    pre = prefill_batch(1, prefill_len)
    runner.run(dec), runner.run(pre)  # warm-up

    def timed(b: object) -> float:
        t0 = time.perf_counter()
        runner.run(b)
        return time.perf_counter() - t0

    print(json.dumps({"ready": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "decode":
            out = statistics.median(timed(dec) for _ in range(int(arg[0])))
        else:
            out = timed(pre)
        print(json.dumps({"s": out}), flush=True)


class Variant:
    def __init__(self, spec: str, args: argparse.Namespace) -> None:
        self.label, self.threads, extra = parse_variant(spec)
        env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
        env.update(extra, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
        self.env_text = ",".join(f"{k}={v}" for k, v in extra.items()) or "(none)"
        cmd = [sys.executable, __file__, "--worker", str(self.threads), "--batch", str(args.batch),
               "--context", str(args.context), "--prefill-len", str(args.prefill_len)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)  # fmt: skip
        self.ready = self.ask("")["ready"]

    def ask(self, cmd: str) -> dict:
        assert self.proc.stdin and self.proc.stdout
        if cmd:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"variant {self.label} exited with {self.proc.wait()}")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(30)


BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    sum(range(100000))"


def busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes that keep a core busy until this one exits (however it exits)."""
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]


def run_rounds(variants: list[Variant], args: argparse.Namespace) -> list[dict[str, dict]]:
    rounds = []
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        got = {}
        for v in order:
            dec = v.ask(f"decode {args.steps}")["s"]
            got[v.label] = {"decode": dec, "prefill": v.ask("prefill")["s"]}
        base = got[variants[0].label]
        line = ", ".join(
            f"{k} {g['decode'] * 1e3:.0f}/{g['prefill'] * 1e3:.0f} ms" for k, g in got.items()
        )
        print(f"  round {r + 1} (decode/prefill): {line}", flush=True)
        for g in got.values():
            g["decode_x"], g["prefill_x"] = (
                g["decode"] / base["decode"],
                g["prefill"] / base["prefill"],
            )
        rounds.append(got)
    return rounds


def report(variants: list[Variant], rounds: list[dict[str, dict]]) -> None:
    base = variants[0].label
    print(
        f"medians of {len(rounds)} rounds (ratio: time / {base}'s in the same round, lower is faster):"
    )
    for v in variants:
        m = {k: statistics.median(r[v.label][k] for r in rounds) for k in rounds[0][v.label]}
        print(f"  {v.label:>10} ({v.ready} threads, {v.env_text}): decode {m['decode'] * 1e3:.1f} ms "
              f"({m['decode_x']:.2f}x), prefill {m['prefill'] * 1e3:.0f} ms ({m['prefill_x']:.2f}x)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--busy", type=int, default=0, help="spinning neighbour processes to start")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="decode steps per variant per round")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.batch, args.context, args.prefill_len)
    from _machine import machine_line

    print(machine_line())
    print(f"workload: SmolLM2-135M float32, decode B={args.batch} at context {args.context} "
          f"(median of {args.steps} steps), prefill 1 x {args.prefill_len} tokens; {args.busy} "
          f"spinning neighbour(s); {args.rounds} rounds; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)  # fmt: skip
    variants = [Variant(s, args) for s in args.variants]
    busy = busy_loops(args.busy)
    try:
        rounds = run_rounds(variants, args)
    finally:
        for b in busy:
            b.kill()
            b.wait()
        for v in variants:
            v.stop()
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(variants, rounds)


if __name__ == "__main__":
    main()
