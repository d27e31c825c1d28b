"""benchmarks/pd_fleet.py in its smallest configuration, so that it cannot rot: a real prefill
and decode pair behind `route --pd-disaggregation` and two aggregated engines behind cache_aware,
each pinned to a core, one long prompt and one generation through each, and a report with every
figure and the ratios. Timings are printed, never asserted."""

from __future__ import annotations

import re

import pytest
from bench_run import run_benchmark

pytest.importorskip("mooncake.engine")
pytest.importorskip("torch")

SMALLEST = ["--rounds", "1", "--duration", "1", "--prompt-tokens", "200", "300",
            "--gen-tokens", "8", "12", "--prompt-interval", "1", "--gen-interval", "1"]  # fmt: skip
FIGURES = (
    "TBT p50",
    "TBT p99",
    "TBT max",
    "longest gap p90",
    "TTFT p50",
    "TTFT p99",
    "long TTFT p50",
    "out tok/s",
    "req/s",
)


def test_the_smallest_pd_benchmark_runs_and_reports_every_figure():
    out = run_benchmark("pd_fleet.py", SMALLEST, timeout=900)
    assert out.startswith("machine: ") and "workload: 1 long prompts of 200-300 tokens" in out
    header = next(ln for ln in out.splitlines() if ln.startswith("run "))
    assert all(h in header for h in FIGURES), header
    for setup in ("pd", "aggregated"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"round 1 {setup} "))
        figures = re.findall(r"\d+(?:\.\d+)?", line.split("  ", 1)[1].split(" gaps")[0])
        assert len(figures) == len(FIGURES) + 1, line  # and the count of TBT samples
        # 1 long prompt (8 tokens) and 1 generation of 8-12: every token streamed, none failed
        assert float(figures[-1]) >= 7 and line.endswith("failed 0"), line
    for figure in FIGURES:
        assert re.search(rf"^  {re.escape(figure)} +[\d.]+x  \[[\d.]+\]$", out, re.M), figure
    assert re.search(r"^goal TBT p99 <= 0.5x aggregated's: (met|not met) \(", out, re.M)
