"""benchmarks/prefill_ab.py in its smallest configuration: the kernels' sources at a git revision
are built beside this tree's, swapped under one real runner (the built-in model through the
real loader) and timed in turn; the report names every figure and a ratio for each."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_prefill_ab_smoke() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no revision to build the base kernels from")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "prefill_ab.py"), "--base", "HEAD",
           "--rounds", "1", "--prompt-len", "40", "--chunk", "32", "--batch", "2",
           "--context", "16"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "prefill 1 x 40 uncached tokens in chunks of 32" in text and "load average" in text
    for what in ("attention 32/32", "attention 8/40", "prefill", "decode step"):
        line = next((ln for ln in text.splitlines() if ln.startswith(f"{what}: base ")), None)
        assert line is not None, text
        assert float(re.findall(r"median (\d+\.\d+)$", line)[0]) > 0, line
