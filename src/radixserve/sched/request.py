"""Requests and their sampling parameters, states, timestamps and finish reasons.

Plain data shared by the scheduler, the runners and the engine; no behaviour beyond accessors.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.tokens import concat_tokens, token_array


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
    # read by the model's logits processors (vLLM's and SGLang's semantics), never here
    min_new_tokens: int = 0  # EOS and stop tokens/strings are held back until reached
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    grammar: tuple[str, str] | None = (
        None  # ("json_schema" | "regex" | "json" | "structural_tag", spec)
    )
    # log probabilities: of the sampled tokens, and of the prompt from logprob_start_len on
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: no prompt logprobs
    # read by the detokenizer
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the output

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check_logit_params(self)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits need the request's token history before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0


# SamplingParams fields that only a real model's logits can honour, with their neutral values
LOGIT_FIELDS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                "min_p": 0.0, "logit_bias": (), "grammar": None, "return_logprob": False}  # fmt: skip


def needs_logits(sp: SamplingParams) -> str | None:
    """The first field of ``sp`` that a runner without logits cannot honour, if any."""
    return next((k for k, v in LOGIT_FIELDS.items() if getattr(sp, k) != v), None)


def _check_logit_params(p: SamplingParams) -> None:
    """The ranges of the fields the logits processors and logprobs read (not only penalties)."""
    if p.min_new_tokens < 0 or p.min_new_tokens > p.max_new_tokens:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(p, name) <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(p, name)}")
    if not p.repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    if not 0 <= p.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}")
    if any(not -100 <= b <= 100 for _, b in p.logit_bias):
        raise ValueError("logit_bias values must be in [-100, 100]")
    if p.top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be >= 0, got {p.top_logprobs_num}")


@dataclass(slots=True, eq=False)
class Req:
    """One generation request and everything the scheduler tracks about it.

    The caller fills the first block; the scheduler owns the rest. Identity is by object
    (``eq=False``), so requests can key dicts and sets. ``input_ids`` may be given as any
    sequence; it is kept as a compact array (``token_array``, converted here once, or taken as
    it is from the tokenizer manager), which the radix tree matches without a conversion.
    """

    rid: str
    input_ids: Sequence[int] = field(repr=False)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # larger runs first under --enable-priority-scheduling
    routing_key: str | None = None  # groups requests for the routing-key policy
    namespace: Hashable | None = None  # cache namespace (LoRA id, cache salt): never shared
    arrival_time: float | None = None  # the scheduler's clock at add_request unless given

    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list, repr=False)
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  # prompt tokens that came from the cache at first admission
    host_cached_tokens: int = 0  # of those, the ones loaded back from the host tier
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
    host_len: int = 0  # usable tokens past prefix_len that only the host tier holds (waiting)
    locked_node: Any = field(
        default=None, repr=False
    )  # tree node this running request holds locked

    def __post_init__(self) -> None:
        self.input_ids = token_array(self.input_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def fill_ids(self) -> array:
        """Prompt plus output so far: what a (re-)admitted request prefills. No copy while
        nothing has been generated, which is the common case."""
        if not self.output_ids:
            return self.input_ids  # type: ignore[return-value]
        return concat_tokens(self.input_ids, self.output_ids)  # type: ignore[arg-type]

    def fill_slice(self, start: int, end: int) -> array:
        """``fill_ids()[start:end]`` without building the whole fill, as an array."""
        ids = self.input_ids
        n = len(ids)
        if end <= n:
            return ids[start:end]  # type: ignore[return-value]
        if start >= n:
            return token_array(self.output_ids[start - n : end - n])
        return concat_tokens(ids[start:], self.output_ids[: end - n])  # type: ignore[arg-type]

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
    host_cached_tokens: int = 0  # of cached_tokens, loaded from the host tier
