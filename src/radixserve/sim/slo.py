"""Time between tokens and goodput under SLOs: the gaps a client sees between a request's
consecutive tokens, and the requests that meet both a TTFT and a TBT bound.

Goodput as Mooncake (FAST'25) and DistServe (OSDI'24) count it: only requests that meet every
latency bound count. A request meets the TBT bound when no gap between two of its consecutive
tokens is longer (a stream that never stalls longer than the bound); DistServe bounds the mean
(TPOT) instead, which a stall of one long prefill step hides."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from operator import sub

from radixserve.config import check_fields
from radixserve.sched.request import TokenOutput

FOLD_GAPS = 1 << 20  # gaps of one weight kept in a list before they are counted


def _f(default: object, help: str, **kw: object) -> object:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class SloConfig:
    """The latency bounds a request must meet to count in goodput (None: unbounded)."""

    slo_ttft_ms: float | None = _f(None, "goodput's bound on time to first token, ms", gt=0)
    slo_tbt_ms: float | None = _f(
        None, "goodput's bound on every time between two tokens of a request, ms", gt=0
    )

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def set(self) -> bool:
        return self.slo_ttft_ms is not None or self.slo_tbt_ms is not None

    def met(self, ttft_s: float, worst_tbt_s: float) -> bool:
        ttft, tbt = self.slo_ttft_ms, self.slo_tbt_ms
        return (ttft is None or ttft_s * 1e3 <= ttft) and (tbt is None or worst_tbt_s * 1e3 <= tbt)

    def describe(self) -> str:
        def one(v: float | None) -> str:
            return "unbounded" if v is None else f"{v:g} ms"

        return f"TTFT <= {one(self.slo_ttft_ms)} and every TBT <= {one(self.slo_tbt_ms)}"


class TokenGaps:
    """Each live request's last token time and longest gap so far, and a histogram of every
    gap (gap -> tokens), fed by the simulator as tokens come out of steps and decode runs."""

    __slots__ = ("last", "worst", "_gaps", "_hist")

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.worst: dict[str, float] = {}
        # gaps not counted yet, by how many tokens each stands for (a decode run's gap is one
        # token of each request in it): lists, folded into ``_hist`` in sorted order. Counting
        # each gap in a dict as it came was a tenth of a run: a gap is a difference of two
        # times hundreds of seconds in, so the low 17-18 bits of its float hash are zero and
        # the dict's probes collide
        self._gaps: dict[int, list[float]] = {}
        self._hist: Counter[float] = Counter()

    @property
    def hist(self) -> Counter[float]:
        """Every gap so far -> the tokens that came that long after the one before."""
        for weight in list(self._gaps):
            self._fold(weight)
        return Counter(self._hist)

    def _fold(self, weight: int) -> None:
        # counted at C level (a run's 370,000 gaps hold some 12,000 distinct ones), then one
        # update per distinct gap: a third less than sorting them and bisecting for each
        hist = self._hist
        get = hist.get
        for gap, n in Counter(self._gaps.pop(weight)).items():
            hist[gap] = get(gap, 0) + weight * n

    def _add(self, weight: int, gaps: Iterable[float]) -> None:
        held = self._gaps.get(weight)
        if held is None:
            held = self._gaps[weight] = []
        held.extend(gaps)
        if len(held) > FOLD_GAPS:  # memory stays bounded however long the run
            self._fold(weight)

    def tokens(self, outs: Iterable[TokenOutput], now: float) -> None:
        """Tokens that came out at ``now`` (a request's first one starts its clock)."""
        last, worst, gaps = self.last, self.worst, []
        for out in outs:
            rid = out.rid
            prev = last.get(rid)
            last[rid] = now
            if prev is not None:
                gap = now - prev
                gaps.append(gap)
                if gap > worst.get(rid, 0.0):
                    worst[rid] = gap
        if gaps:
            self._add(1, gaps)

    def start(self, rid: str, t: float) -> None:
        """``rid``'s first token reached its client at ``t`` (a decode engine received it)."""
        self.last[rid] = t

    def run(self, rids: Sequence[str], ends: Sequence[float]) -> None:
        """A run of decode steps ending at ``ends``: every request in ``rids`` got a token at
        each end."""
        if not ends:
            return
        last, worst = self.last, self.worst
        inner = list(map(sub, islice(ends, 1, None), ends))  # each step's end minus the last's
        self._add(len(rids), inner)
        top = max(inner, default=0.0)
        firsts = []
        for rid in rids:
            gap = ends[0] - last.get(rid, ends[0])
            firsts.append(gap)
            worst[rid] = max(worst.get(rid, 0.0), gap, top)
            last[rid] = ends[-1]
        self._add(1, firsts)

    def pop(self, rid: str) -> float:
        """A finished request's longest gap (0: fewer than two tokens); forgets it."""
        self.last.pop(rid, None)
        return self.worst.pop(rid, 0.0)


def gap_percentiles(hist: Counter[float], qs: Sequence[int] = (50, 99)) -> dict[str, float]:
    """Percentiles of every gap (nearest rank over the histogram; nan without gaps)."""
    total = sum(hist.values())
    out = {f"p{q}": math.nan for q in qs}
    if not total:
        return out
    items = sorted(hist.items())
    for q in qs:
        rank, seen = max(1, math.ceil(q / 100 * total)), 0
        for gap, n in items:
            seen += n
            if seen >= rank:
                out[f"p{q}"] = gap
                break
    return out


@dataclass(frozen=True, slots=True)
class Goodput:
    met: int  # finished requests that met every bound
    share: float  # of the finished requests
    rate: float  # per second of the run


def goodput(slo: SloConfig, ttft: Sequence[float], worst: Sequence[float], secs: float) -> Goodput:
    """Requests (``ttft[i]``, ``worst[i]``: one finished request's TTFT and longest gap) that
    meet ``slo``."""
    met = sum(slo.met(t, w) for t, w in zip(ttft, worst, strict=True))
    return Goodput(met, met / len(ttft) if ttft else 0.0, met / secs if secs else 0.0)
