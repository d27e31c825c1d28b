"""benchmarks/agent_fleet.py in its smallest configuration, so that it cannot rot: two real
engines behind two router policies, agents with tools, and a report whose cached shares come
from the engines. Timings are printed, never asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SMALLEST = ["--engines", "2", "--agents", "2", "--turns", "2", "--tools", "2",
            "--max-tokens", "2", "--policies", "round_robin", "kv_aware"]  # fmt: skip


def test_the_smallest_agent_benchmark_runs_and_reports_every_policy():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "benchmarks/agent_fleet.py", *SMALLEST], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert out.startswith("machine: ") and "workload: 2 agents x 2 turns" in out
    rows = dict(re.findall(r"^(round_robin|kv_aware) +([\d.]+)% ", out, re.M))
    assert set(rows) == {"round_robin", "kv_aware"}, out
    # an agent's second turn resends its first: every policy finds some of it cached
    assert all(float(share) > 0 for share in rows.values()), out
    kv_row = next(ln for ln in out.splitlines() if ln.startswith("kv_aware "))
    assert re.search(r"\d+/\d+ +[\d.]+x / ", kv_row), kv_row  # split and ratios vs round_robin
    assert "  round_robin: cached" in out and "4 requests" in out
