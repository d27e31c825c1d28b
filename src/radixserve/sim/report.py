"""What one simulated run measured: throughput, cache hit rate, latency percentiles and per-engine
load; plus the comparison table that several runs print as one."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.sched.request import Req
from radixserve.sim.slo import SloConfig, gap_percentiles, goodput
from radixserve.sim.tiers import TIERS, Landing, deepest_tier, split_by_tier

PERCENTILES = (50, 90, 99)
# a rejection's reason without the request's own numbers, so equal reasons count together
_REQUEST = re.compile(r"^request '[^']*': ")
_SIZES = re.compile(r"prompt \(\d+ tokens\) \+ max_new_tokens \(\d+\)")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of sorted values, linearly interpolated (nan if empty)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean and p50/p90/p99 of ``values``."""
    s = sorted(values)
    out = {"mean": sum(s) / len(s) if s else math.nan}
    out.update({f"p{q}": percentile(s, q) for q in PERCENTILES})
    return out


def max_over_mean(values: Sequence[float]) -> float:
    """How much busier the busiest is than the average (1.0: perfectly even)."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


@dataclass(slots=True)
class EngineLoad:
    """What one engine was given and did."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    busy_s: float = 0.0  # virtual seconds spent running batches
    steps: int = 0


@dataclass(slots=True)
class SimResult:
    label: str
    num_requests: int
    engines: list[EngineLoad]
    num_finished: int = 0
    num_rejected: int = 0  # could never fit an engine's context or KV pool
    rejected: Counter[str] = field(default_factory=Counter)  # why -> how many
    rejected_rids: set[str] = field(default_factory=set, repr=False)
    router: str = ""  # what ran: the router policy and the engines' schedule policy
    schedule_policy: str = ""
    num_unfinished: int = 0  # must be 0: no request is ever lost
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    first_arrival: float = math.inf
    last_finish: float = 0.0
    wall_s: float = 0.0
    best_hit_rate: float | None = None
    prompt_blocks: int = 0  # trace replay: hash ids of finished prompts
    cached_blocks: int = 0  # ... of which the engine had cached
    ttft: list[float] = field(default_factory=list, repr=False)
    tpot: list[float] = field(default_factory=list, repr=False)
    e2e: list[float] = field(default_factory=list, repr=False)
    wait: list[float] = field(default_factory=list, repr=False)  # arrival -> first scheduled
    # each finished request's longest time between two tokens (in ``ttft``'s order), and every
    # gap: gap -> tokens (sim/slo.py)
    tbt_worst: list[float] = field(default_factory=list, repr=False)
    tbt_hist: Counter[float] = field(default_factory=Counter, repr=False)
    slo: SloConfig = field(default_factory=SloConfig)  # goodput's bounds
    pd: dict[str, Any] = field(default_factory=dict)  # prefill/decode apart: the split, transfers
    # cached prompt tokens by the tier they came from (device, host, store; their sum is
    # cached_tokens), and TTFTs by the lowest tier a request's prefix reached (or miss)
    tier_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS[:3], 0))
    tier_ttft: dict[str, list[float]] = field(
        default_factory=lambda: {t: [] for t in TIERS}, repr=False
    )
    tiers: dict[str, Any] = field(default_factory=dict)  # what the tiers were and moved

    @classmethod
    def empty(cls, label: str, num_requests: int, num_engines: int) -> SimResult:
        return cls(label, num_requests, [EngineLoad() for _ in range(num_engines)])

    def record(self, req: Req) -> None:
        """Account a finished request."""
        arrival = req.arrival_time or 0.0
        n = len(req.output_ids)
        self.num_finished += 1
        self.prompt_tokens += len(req.input_ids)
        self.cached_tokens += req.cached_tokens
        self.output_tokens += n
        self.first_arrival = min(self.first_arrival, arrival)
        self.last_finish = max(self.last_finish, req.finish_time or 0.0)
        first = req.first_token_time or arrival
        self.ttft.append(first - arrival)
        self.e2e.append((req.finish_time or first) - arrival)
        self.wait.append((req.first_scheduled_time or first) - arrival)
        if n > 1:
            self.tpot.append(((req.finish_time or first) - first) / (n - 1))

    def record_tbt(self, worst: float) -> None:
        """The longest gap between two tokens of the request ``record`` took last."""
        self.tbt_worst.append(worst)

    def tbt(self) -> dict[str, float]:
        """p50 / p99 over every gap between two tokens of a request, in seconds."""
        return gap_percentiles(self.tbt_hist)

    def goodput(self) -> tuple[float, float] | None:
        """Share of the finished requests and requests/s that met every SLO (None: no SLO)."""
        if not self.slo.set:
            return None
        g = goodput(self.slo, self.ttft, self.tbt_worst, self.duration_s)
        return g.share, g.rate

    def record_tiers(self, req: Req, landing: Landing | None = None) -> None:
        """Account a finished request's cached tokens by tier, and its TTFT under the lowest
        tier it reached (``landing``: what the simulator loaded for it below its device match,
        see sim/tiers.py)."""
        split = split_by_tier(req.cached_tokens, req.host_cached_tokens, landing)
        for tier, tokens in split.items():
            self.tier_tokens[tier] += tokens
        arrival = req.arrival_time or 0.0
        first = req.first_token_time or arrival
        self.tier_ttft[deepest_tier(split)].append(first - arrival)

    def reject(self, rid: str, why: str) -> None:
        """Account a request no engine can ever serve (``why``: the scheduler's reason)."""
        self.num_rejected += 1
        self.rejected_rids.add(rid)
        self.rejected[_REQUEST.sub("", _SIZES.sub("prompt + max_new_tokens", why))] += 1

    def rejections(self) -> str:
        """One line: how many were rejected and why ("" if none)."""
        if not self.num_rejected:
            return ""
        why = "; ".join(f"{n} x {reason}" for reason, n in self.rejected.most_common())
        return f"{self.num_rejected} of {self.num_requests} requests rejected ({why})"

    # -- derived -----------------------------------------------------------------------------
    @property
    def duration_s(self) -> float:
        """Virtual seconds from the first arrival to the last finish."""
        return max(self.last_finish - self.first_arrival, 0.0) if self.num_finished else 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def tier_hit_rates(self) -> dict[str, float]:
        """Share of prompt tokens served from each tier (their sum is ``hit_rate``)."""
        total = self.prompt_tokens or 1
        return {t: n / total for t, n in self.tier_tokens.items()}

    def tier_lines(self) -> str:
        """Hits by tier and TTFT by the lowest tier each request's prefix reached."""
        hits = ", ".join(f"{t} {r:.1%}" for t, r in self.tier_hit_rates().items())
        parts = []
        for tier, values in self.tier_ttft.items():
            if values:
                s = summarize(values)
                parts.append(f"{tier} {len(values)} x {s['mean']:.2f}/{s['p99']:.2f}")
        return (
            f"{self.label}: hits by tier {hits} (of {self.hit_rate:.1%}); "
            f"TTFT mean/p99 s by lowest tier: {'; '.join(parts)}"
        )

    @property
    def block_hit_rate(self) -> float | None:
        """Trace replay: share of prompt blocks (hash ids) served from the cache."""
        return self.cached_blocks / self.prompt_blocks if self.prompt_blocks else None

    def record_blocks(self, req: Req, num_blocks: int, block_tokens: int) -> None:
        """Count a trace request's cached blocks: whole blocks within its cached prefix (a
        prompt cached whole but the one token an engine must compute counts whole)."""
        cached = req.cached_tokens
        whole = cached >= len(req.input_ids) - 1
        self.prompt_blocks += num_blocks
        self.cached_blocks += num_blocks if whole else min(cached // block_tokens, num_blocks)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    @property
    def total_throughput(self) -> float:
        tokens = self.output_tokens + self.prompt_tokens
        return tokens / self.duration_s if self.duration_s else 0.0

    @property
    def sim_requests_per_min(self) -> float:
        """Simulation speed: requests simulated per minute of wall time."""
        return 60 * self.num_requests / self.wall_s if self.wall_s else math.inf

    def imbalance(self) -> dict[str, float]:
        """Busiest engine over the mean, by requests, prompt tokens and busy time."""
        return {
            "requests": max_over_mean([e.requests for e in self.engines]),
            "prompt_tokens": max_over_mean([e.prompt_tokens for e in self.engines]),
            "busy_s": max_over_mean([e.busy_s for e in self.engines]),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "router": self.router,
            "schedule_policy": self.schedule_policy,
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_rejected": self.num_rejected,
            "rejected": dict(self.rejected),
            "num_unfinished": self.num_unfinished,
            "duration_s": self.duration_s,
            "output_throughput": self.output_throughput,
            "total_throughput": self.total_throughput,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "hit_rate": self.hit_rate,
            "best_hit_rate": self.best_hit_rate,
            "block_hit_rate": self.block_hit_rate,
            "ttft_s": summarize(self.ttft),
            "tier_tokens": dict(self.tier_tokens),
            "tier_ttft_s": {t: summarize(v) | {"n": len(v)} for t, v in self.tier_ttft.items()},
            "tiers": self.tiers,
            "tpot_s": summarize(self.tpot),
            "tbt_s": self.tbt(),
            "tbt_worst_s": summarize(self.tbt_worst),
            "slo": {"ttft_ms": self.slo.slo_ttft_ms, "tbt_ms": self.slo.slo_tbt_ms},
            "goodput": dict(zip(("share", "requests_per_s"), self.goodput() or (None, None))),
            "pd": self.pd,
            "e2e_s": summarize(self.e2e),
            "wait_s": summarize(self.wait),
            "imbalance": self.imbalance(),
            "engines": [
                {
                    "requests": e.requests,
                    "prompt_tokens": e.prompt_tokens,
                    "cached_tokens": e.cached_tokens,
                    "busy_s": e.busy_s,
                    "steps": e.steps,
                }
                for e in self.engines
            ],
            "wall_s": self.wall_s,
            "sim_requests_per_min": self.sim_requests_per_min,
        }


# -- the comparison table ---------------------------------------------------------------------

_COLUMNS: list[tuple[str, str]] = [
    ("policy", "{}"),
    ("out tok/s", "{:,.0f}"),
    ("tot tok/s", "{:,.0f}"),
    ("hit", "{:.1%}"),
    ("best", "{}"),
    ("TTFT p50/p90/p99 s", "{}"),
    ("TPOT p50/p99 ms", "{}"),
    ("TBT p50/p99 ms", "{}"),
    ("goodput", "{}"),
    ("e2e p50/p90/p99 s", "{}"),
    ("wait p99 s", "{:.2f}"),
    ("max/mean req", "{:.2f}"),
    ("max/mean busy", "{:.2f}"),
    ("done", "{}"),
]


def _row(r: SimResult) -> list[str]:
    t, p, e = summarize(r.ttft), summarize(r.tpot), summarize(r.e2e)
    tbt, good = r.tbt(), r.goodput()
    imb = r.imbalance()
    best = "-" if r.best_hit_rate is None else f"{r.best_hit_rate:.1%}"
    cells = [
        r.label,
        r.output_throughput,
        r.total_throughput,
        r.hit_rate,
        best,
        f"{t['p50']:.2f}/{t['p90']:.2f}/{t['p99']:.2f}",
        f"{1e3 * p['p50']:.1f}/{1e3 * p['p99']:.1f}",
        f"{1e3 * tbt['p50']:.1f}/{1e3 * tbt['p99']:.1f}",
        "-" if good is None else f"{good[0]:.1%} {good[1]:.2f}/s",
        f"{e['p50']:.2f}/{e['p90']:.2f}/{e['p99']:.2f}",
        summarize(r.wait)["p99"],
        imb["requests"],
        imb["busy_s"],
        f"{r.num_finished}/{r.num_requests}",
    ]
    return [fmt.format(c) for (_, fmt), c in zip(_COLUMNS, cells)]


def format_table(results: Sequence[SimResult]) -> str:
    """One row per run; the first row is the baseline that ratios are taken against."""
    rows = [[name for name, _ in _COLUMNS]] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(results) > 1 and results[0].output_throughput:
        base = results[0]
        for r in results[1:]:
            lines.append(
                f"{r.label} vs {base.label}: throughput x{r.output_throughput / base.output_throughput:.2f}, "
                f"hit rate {base.hit_rate:.1%} -> {r.hit_rate:.1%}{_goodput_change(base, r)}"
            )
    return "\n".join(lines)


def _goodput_change(base: SimResult, r: SimResult) -> str:
    a, b = base.goodput(), r.goodput()
    if a is None or b is None:
        return ""
    return f", goodput {a[0]:.1%} -> {b[0]:.1%}"
