"""One simulated engine's state in ClusterSim (its scheduler, runner, batch in flight, load
and store link), the booked run of pure decode steps it may have in flight, and the kinds of
the event loop's events."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.router.policies.base import WorkerView
from radixserve.sched.batch import Batch, StepResult
from radixserve.sched.scheduler import Scheduler
from radixserve.sim.report import EngineLoad
from radixserve.sim.runner import SimRunner

# the event loop's kinds, in their order at equal times (see sim/cluster.py)
_ARRIVE, _DONE, _WAKE, _LAND = 0, 1, 2, 3
RUN_CHUNK = 64  # decode steps a run times at first (then twice as many at each chunk's end)


class _Engine:
    """One simulated engine: its scheduler and runner, the batch in flight and its load."""

    __slots__ = (
        "idx", "sched", "runner", "batch", "result", "awake", "load", "requests", "tokens", "run",
        "ratio", "host_ratio", "link_free", "landed",
    )  # fmt: skip

    def __init__(
        self,
        idx: int,
        sched: Scheduler,
        runner: SimRunner,
        ratio: float | None = None,
        host_ratio: float | None = None,
    ) -> None:
        self.idx, self.sched, self.runner = idx, sched, runner
        # the load-to-prefill ratios it reports, its cost model's: the store's and the host
        # tier's (None: no such tier)
        self.ratio, self.host_ratio = ratio, host_ratio
        self.link_free = 0.0  # when its link to the store is free for the next get
        self.landed: list[tuple[str, int]] = []  # store loads landed: applied at its next step
        self.batch: Batch | None = None
        self.result: StepResult | None = None
        self.awake = False  # a step is running or a wake-up is queued
        self.run: _DecodeRun | None = None  # a run of pure decode steps in flight
        self.load = EngineLoad()
        self.requests = self.tokens = 0  # dispatched and not finished: the router's view

    def view(self) -> WorkerView:
        return WorkerView(self.idx, self.requests, True, self.tokens)

    def reported_view(self, now: float) -> WorkerView:
        """The view plus the prefill tokens this engine has yet to compute, as a worker
        reports them to kv_aware."""
        left = self.sched.waiting_prefill_tokens()  # what /get_loads reports
        return WorkerView(self.idx, self.requests, True, self.tokens, left, now,
                          self.host_ratio, self.ratio)  # fmt: skip


@dataclass(slots=True)
class _DecodeRun:
    """Pure decode steps booked at once: the first ones' durations and end times (computed a
    chunk at a time: a dispatch often cuts a run early), the booked steps and the contexts
    they start from, the sequence number of the DONE event that ends the run (a cut run books
    a new one), and that of the event in the heap (this one, or a chunk's end)."""

    durations: list[float]
    ends: list[float]
    seq: int
    steps: int
    contexts: list[int]
    pending: int = 0
