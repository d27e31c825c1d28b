"""Running a benchmark script as a user would, for the smoke tests of its smallest configuration:
the checkout's sources first, one torch thread, the output returned (a failure shows its tail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, args: list[str], timeout: float) -> str:
    """`python benchmarks/<script> <args>` from the repository root; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout
