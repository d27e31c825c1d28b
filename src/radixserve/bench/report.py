"""What a bench run measured, summed up: throughput, TTFT / ITL / end-to-end percentiles and the
cached prompt tokens the server reported; as a dict (JSON), a text block and a PNG."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from radixserve.bench.loadgen import RequestRecord

PERCENTILES = (50, 90, 99)


def _percentile(s: Sequence[float], q: float) -> float:
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(values: Sequence[float]) -> dict[str, float]:
    s = sorted(1e3 * v for v in values)
    out = {"mean": sum(s) / len(s) if s else math.nan}
    out.update({f"p{q}": _percentile(s, q) for q in PERCENTILES})
    return out


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    # the whole run, failed requests included: a run whose failures took minutes took minutes
    start = min((r.sent for r in records), default=0.0)
    end = max((_ended(r) for r in records), default=0.0)
    duration = end - start
    out_tokens = sum(r.output_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens or 0 for r in reported)
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    errors = sorted({r.error for r in records if r.error})
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "output_tokens": out_tokens,
        "prompt_ids": sum(r.prompt_len for r in ok),
        "ttft_ms": _ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _ms([x for r in ok for x in r.itl]),
        "e2e_ms": _ms([r.e2e for r in ok if r.e2e is not None]),
        # the server's own count: None when it reports no cached tokens
        "cached_tokens": cached if reported else None,
        "reported_prompt_tokens": prompt if reported else None,
        "cache_hit_rate": cached / prompt if prompt else None,
    }


def _ended(r: RequestRecord) -> float:
    return r.ended if r.ended is not None else r.sent + (r.e2e or 0.0)


def format_summary(s: dict[str, Any], best: float | None = None) -> str:
    def row(name: str, d: dict[str, float]) -> str:
        return f"  {name:<5} mean {d['mean']:9.1f}  " + "  ".join(
            f"p{q} {d[f'p{q}']:9.1f}" for q in PERCENTILES
        )

    hit = s["cache_hit_rate"]
    cached = "not reported by the server" if hit is None else f"{s['cached_tokens']:,} ({hit:.1%})"
    lines = [
        f"requests: {s['completed']}/{s['requests']} completed, {s['failed']} failed"
        + (f" ({'; '.join(s['errors'])})" if s["errors"] else ""),
        f"duration: {s['duration_s']:.2f} s; {s['request_throughput']:.2f} req/s, "
        f"{s['output_throughput']:,.0f} output tokens/s",
        f"cached prompt tokens: {cached}"
        + ("" if best is None else f"; best achievable hit rate: {best:.1%}"),
        "latency (ms):",
        row("TTFT", s["ttft_ms"]),
        row("ITL", s["itl_ms"]),
        row("e2e", s["e2e_ms"]),
    ]
    return "\n".join(lines)


def plot_records(records: Sequence[RequestRecord], path: str, title: str = "") -> None:
    """CDFs of TTFT and end-to-end latency, and when each request ran."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'radixserve[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, name, values in (
        (axes[0], "TTFT (ms)", [1e3 * (r.ttft or 0.0) for r in ok]),
        (axes[1], "end-to-end latency (ms)", [1e3 * (r.e2e or 0.0) for r in ok]),
    ):
        s = sorted(values)
        ax.plot(s, [(i + 1) / len(s) for i in range(len(s))])
        ax.set_xlabel(name)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    axes[2].scatter([r.sent for r in ok], [1e3 * (r.e2e or 0.0) for r in ok], s=4)
    axes[2].set_xlabel("sent at (s)")
    axes[2].set_ylabel("end-to-end latency (ms)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
