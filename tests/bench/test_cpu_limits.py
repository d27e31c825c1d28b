"""benchmarks/cpu_limits.py in its smallest configuration: the real built-in model through the
real loader runs a chunked prefill and decode steps, and the report names every figure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_limits_smoke() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu_limits.py"), "--rounds", "1",
           "--prompt-len", "40", "--chunk", "32", "--batch", "2", "--context", "16",
           "--gemm-sizes", "128", "--stream-mib", "4", "--prefill-reps", "1",
           "--decode-reps", "1", "--stream-reps", "1", "--gemm-reps", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "lscpu: " in text and "load average" in text
    assert "prefill 1 x 40 uncached tokens in chunks of 32" in text
    for label in ("x GEMM ceiling (goal >= 0.9x: ", "ms = ", "(goal <= 1.5x: "):
        assert label in text, text
    ratios = re.findall(r" = (\d+\.\d+)x", text)
    assert len(ratios) == 2 and all(float(r) > 0 for r in ratios), text
