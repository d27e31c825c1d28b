"""Requests and their sampling parameters, states, timestamps and finish reasons.

Plain data shared by the scheduler, the runners and the engine; no behaviour beyond accessors.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached (or the context is full)
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True, eq=False)
class Req:
    """One generation request and everything the scheduler tracks about it.

    The caller fills the first block; the scheduler owns the rest. Identity is by object
    (``eq=False``), so requests can key dicts and sets.
    """

    rid: str
    input_ids: list[int] = field(repr=False)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # larger runs first under --enable-priority-scheduling
    routing_key: str | None = None  # groups requests for the routing-key policy
    namespace: Hashable | None = None  # cache namespace (LoRA id, cache salt): never shared
    arrival_time: float | None = None  # the scheduler's clock at add_request unless given

    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list, repr=False)
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  # prompt tokens that came from the cache at first admission
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    queued_at: float = 0.0  # when it last entered the waiting queue (bounded waiting)
    num_retractions: int = 0

    # scheduler bookkeeping: arrival order, KV progress and the tracked prefix match
    seq: int = 0
    kv_len: int = 0  # positions whose KV is allocated (computed once the step returns)
    match_node: Any = field(
        default=None, repr=False
    )  # tree node the cached prefix ends at (waiting requests)
    match_len: int = 0  # tokens of the fill that the tree holds (uncapped)
    prefix_len: int = 0  # usable cached prefix: match_len capped so one token is computed
    locked_node: Any = field(
        default=None, repr=False
    )  # tree node this running request holds locked

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def fill_ids(self) -> list[int]:
        """Prompt plus output so far: what a (re-)admitted request prefills. No copy while
        nothing has been generated, which is the common case."""
        if not self.output_ids:
            return self.input_ids
        return self.input_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """``fill_ids()[start:end]`` without building the whole fill."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]

    def is_finished(self) -> bool:
        return self.state in (ReqState.FINISHED, ReqState.ABORTED)


@dataclass(slots=True)
class TokenOutput:
    """One generated token, as ``Scheduler.on_output`` reports it to the engine."""

    rid: str
    token_id: int
    finished: bool
    finish_reason: FinishReason | None
    cached_tokens: int
