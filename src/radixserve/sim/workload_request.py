"""One request of a workload as a plain record (``WorkloadRequest``), and how a driver sends a
workload's requests: Poisson arrival times, and ``Chains`` of a chat's turns sent one after another."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload: what to send, when, and which prefix family it belongs to."""

    rid: str
    arrival_s: float
    input_ids: list[int]
    output_len: int
    group: str | None = None  # shared-prefix group
    session: str | None = None  # multi-turn chat session
    turn: int = 0
    # the previous turn of the session: a closed-loop driver sends this request only after
    # that one finished (plus a think time); ``arrival_s`` is the open-loop estimate
    prev_rid: str | None = None
    hash_ids: tuple[int, ...] = ()  # trace replay: one id per block of the prompt


class Chains:
    """How a closed-loop driver (the simulator, ``radixserve bench``) sends ``reqs``: the roots
    go at their arrival times; each other request follows the request named by its
    ``prev_rid``, sent once that one finished plus a think time (a chat's next turn)."""

    def __init__(self, reqs: Sequence[WorkloadRequest]) -> None:
        self.reqs = reqs
        index = {r.rid: i for i, r in enumerate(reqs)}
        self.roots: list[int] = []
        self.followers: dict[int, list[int]] = {}
        for j, r in enumerate(reqs):
            if r.prev_rid is not None and r.prev_rid in index:
                self.followers.setdefault(index[r.prev_rid], []).append(j)
            else:
                self.roots.append(j)

    def after(self, i: int) -> list[tuple[int, float]]:
        """What request ``i`` finishing releases: (index, think time in seconds) pairs."""
        reqs = self.reqs
        return [
            (j, max(reqs[j].arrival_s - reqs[i].arrival_s, 0.0)) for j in self.followers.get(i, ())
        ]


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times of ``n`` requests of a Poisson process (``rate`` per second; inf: all at 0)."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out
