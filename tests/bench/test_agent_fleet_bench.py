"""benchmarks/agent_fleet.py in its smallest configuration, so that it cannot rot: two real
engines behind two router policies, agents with tools, and a report whose cached shares come
from the engines. Timings are printed, never asserted."""

from __future__ import annotations

import re

import pytest
from bench_run import run_benchmark

pytest.importorskip("torch")

SMALLEST = ["--engines", "2", "--agents", "2", "--turns", "2", "--tools", "2",
            "--max-tokens", "2", "--policies", "round_robin", "kv_aware"]  # fmt: skip


def test_the_smallest_agent_benchmark_runs_and_reports_every_policy():
    out = run_benchmark("agent_fleet.py", SMALLEST, timeout=600)
    assert out.startswith("machine: ") and "workload: 2 agents x 2 turns" in out
    rows = dict(re.findall(r"^(round_robin|kv_aware) +([\d.]+)% ", out, re.M))
    assert set(rows) == {"round_robin", "kv_aware"}, out
    # an agent's second turn resends its first: every policy finds some of it cached
    assert all(float(share) > 0 for share in rows.values()), out
    kv_row = next(ln for ln in out.splitlines() if ln.startswith("kv_aware "))
    assert re.search(r"\d+/\d+ +[\d.]+x / ", kv_row), kv_row  # split and ratios vs round_robin
    assert "  round_robin: cached" in out and "4 requests" in out
