"""The comparison as a PNG: throughput, hit rate against the best, tail latency, and the hit-rate
versus p99-wait trade-off. matplotlib is optional (the `plot` extra) and imported only here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.sim.report import SimResult, summarize


def import_pyplot() -> Any:
    """matplotlib's pyplot on a file-only backend, or a clear error if it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'radixserve[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_results(results: Sequence[SimResult], path: str, title: str = "") -> None:
    plt = import_pyplot()
    labels = [r.label for r in results]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    ax.bar(labels, [r.output_throughput for r in results], color="tab:blue")
    ax.set_title("output throughput (tokens/s)")
    ax = axes[0][1]
    ax.bar(labels, [100 * r.hit_rate for r in results], color="tab:green", label="measured")
    best = results[0].best_hit_rate
    if best is not None:
        ax.axhline(100 * best, color="black", linestyle="--", label="best placement")
    ax.set_title("prompt cache hit rate (%)")
    ax.legend(loc="lower right")
    ax = axes[1][0]
    p99 = [summarize(r.ttft)["p99"] for r in results]
    p50 = [summarize(r.ttft)["p50"] for r in results]
    ax.bar(labels, p99, color="tab:red", label="p99")
    ax.bar(labels, p50, color="tab:orange", label="p50")
    ax.set_title("time to first token (s)")
    ax.legend()
    ax = axes[1][1]
    for r in results:
        wait = summarize(r.wait)["p99"]
        ax.scatter(wait, 100 * r.hit_rate)
        ax.annotate(r.label, (wait, 100 * r.hit_rate), fontsize=8)
    ax.set_xlabel("p99 queue wait (s)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title("hit rate versus p99 wait")
    for a in axes.flat[:3]:
        a.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
