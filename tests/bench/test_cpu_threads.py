"""benchmarks/cpu_threads.py in its smallest configuration: two variants of the real built-in
model in worker processes of their own, interleaved, each reported against the first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_threads_smoke() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu_threads.py"), "--rounds", "2",
           "--steps", "1", "--batch", "2", "--context", "8", "--prefill-len", "8", "--busy", "1",
           "--variants", "spin:1:GOMP_SPINCOUNT=300000", "passive:1:OMP_WAIT_POLICY=PASSIVE"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "1 spinning neighbour(s); 2 rounds" in text
    assert "spin (1 threads, GOMP_SPINCOUNT=300000): decode" in text, text
    assert "passive (1 threads, OMP_WAIT_POLICY=PASSIVE): decode" in text, text
    assert re.search(r"spin \(1 threads.*\(1\.00x\), prefill .*\(1\.00x\)", text), text
