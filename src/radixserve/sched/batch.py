"""The plain data that crosses from the scheduler to a runner and back.

No tensors here: a Batch is lists of ints, so the same scheduler drives the torch runner, the
simulated runner and the discrete-event simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.sched.request import SamplingParams


@dataclass(slots=True)
class BatchEntry:
    """One request's share of a forward step.

    ``token_ids`` are computed at positions ``start_pos .. start_pos + len(token_ids) - 1``;
    ``slots`` holds the KV slot of every position ``0 .. start_pos + len(token_ids) - 1`` (the
    cached context first, then the slots the new tokens' K/V are written to).
    """

    rid: str
    token_ids: list[int]
    start_pos: int
    slots: list[int]
    sample: bool  # False for a prefill chunk that does not reach the end of the prompt
    sampling: SamplingParams
    is_prefill: bool
    # tokens generated so far; with the sampling seed it makes seeded sampling reproducible
    # after a retraction
    num_generated: int = 0
    # the request's own token lists (shared, not copied): penalties and grammars read them
    prompt_ids: Sequence[int] = field(default=(), repr=False)
    output_ids: Sequence[int] = field(default=(), repr=False)

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class Batch:
    """A forward step: prefill chunks and/or decodes, in one list."""

    entries: list[BatchEntry] = field(default_factory=list)
    step_id: int = 0
    # page copies between the KV tiers (cache.tiers.PageCopy: slot ids only), to be applied in
    # order before this step's forward, which may overwrite a slot a copy reads
    kv_copies: list[Any] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        return any(e.is_prefill for e in self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries)


# (token id, its log-probability, the top alternatives as (token id, log-probability) pairs)
TokenLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass(slots=True)
class EntryLogprobs:
    """Log-probabilities one entry's step produced: of its sampled token (None if it sampled
    none), and of the prompt tokens at positions ``prompt_start ..`` that this step computed."""

    sampled: TokenLogprob | None = None
    prompt_start: int = 0
    prompt: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """What a runner returns: one next token per entry (None where ``sample`` was False),
    and, for a simulated runner, how long the step took in seconds. ``logprobs`` maps the
    index of an entry that asked for them to what its step produced."""

    next_token_ids: list[int | None]
    duration: float | None = None
    logprobs: dict[int, EntryLogprobs] = field(default_factory=dict)
