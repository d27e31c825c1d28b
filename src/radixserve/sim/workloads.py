"""Generated workloads as plain request records (shared-prefix groups, multi-turn chat, a
shared-prefix mix) and the registry of every workload by name, trace replay included.

Also the import path of what the workloads are made of (workload_request.py), trace replay
(trace_replay.py), the best hit rate a workload allows (hit_rates.py) and the text rendering of
token ids (modelfiles/sim_tokenizer.py): those names are re-exported here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from radixserve.config import check_fields
from radixserve.modelfiles.sim_tokenizer import (  # noqa: F401  (re-exported: workloads as text)
    SIM_VOCAB_SIZE,
    parse_text,
    render_text,
)
from radixserve.sim.hit_rates import block_hit_rate, ideal_prefix_hit_rate  # noqa: F401
from radixserve.sim.trace_replay import (  # noqa: F401  (re-exported: trace replay)
    TraceConfig,
    TraceRecord,
    read_trace,
    trace_replay,
)
from radixserve.sim.workload_request import (  # noqa: F401  (re-exported: the records)
    Chains,
    WorkloadRequest,
    poisson_arrivals,
)

ReplyFn = Callable[[list[int], int], list[int]]  # (prompt ids, n) -> the assistant's n tokens


def _opt(default: Any, help: str, **bounds: Any) -> Any:
    return field(default=default, metadata={"help": help, **bounds})


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _length(rng: random.Random, n: int, range_ratio: float) -> int:
    return rng.randint(max(1, int(n * range_ratio)), n)


# --- generated shared prefix -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    """SGLang's generated-shared-prefix dataset (its --gsp-* flags, with their defaults)."""

    num_groups: int = _opt(64, "groups, each with its own system prompt")
    prompts_per_group: int = _opt(16, "questions per group (requests sharing one system prompt)")
    system_prompt_len: int = _opt(2048, "tokens of each group's system prompt")
    question_len: int = _opt(128, "tokens of each question")
    output_len: int = _opt(256, "tokens to generate per request")
    range_ratio: float = _opt(1.0, "lengths drawn uniformly from [ratio * len, len]")
    ordered: bool = _opt(False, "keep group order instead of shuffling the requests")
    request_rate: float = _opt(math.inf, "Poisson arrivals per second (inf: all at time 0)", gt=0)
    vocab_size: int = _opt(SIM_VOCAB_SIZE, "token ids are drawn from [0, vocab_size)", ge=3)
    seed: int = _opt(0, "seed of the generator")

    def __post_init__(self) -> None:
        check_fields(self)
        if min(self.num_groups, self.prompts_per_group, self.system_prompt_len) < 1:
            raise ValueError("num_groups, prompts_per_group and system_prompt_len must be >= 1")
        if self.question_len < 0 or self.output_len < 1:
            raise ValueError("question_len must be >= 0 and output_len >= 1")
        if not 0 < self.range_ratio <= 1:
            raise ValueError(f"range_ratio must be in (0, 1], got {self.range_ratio}")


def generated_shared_prefix(cfg: SharedPrefixConfig) -> list[WorkloadRequest]:
    """``num_groups x prompts_per_group`` prompts: a group's system prompt plus a question."""
    rng = random.Random(cfg.seed)
    rows: list[tuple[str, str, list[int]]] = []
    for g in range(cfg.num_groups):
        system = _random_ids(
            rng, _length(rng, cfg.system_prompt_len, cfg.range_ratio), cfg.vocab_size
        )
        for p in range(cfg.prompts_per_group):
            n = _length(rng, cfg.question_len, cfg.range_ratio) if cfg.question_len else 0
            rows.append((f"gsp-g{g}-p{p}", f"g{g}", system + _random_ids(rng, n, cfg.vocab_size)))
    if not cfg.ordered:
        rng.shuffle(rows)
    arrivals = poisson_arrivals(len(rows), cfg.request_rate, rng)
    return [
        WorkloadRequest(rid, t, ids, _length(rng, cfg.output_len, cfg.range_ratio), group=group)
        for (rid, group, ids), t in zip(rows, arrivals, strict=True)
    ]


# --- multi-turn chat -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    """Chat sessions whose prompt is the whole history so far plus a new user message."""

    num_sessions: int = _opt(32, "concurrent chat sessions")
    turns: int = _opt(4, "turns per session")
    system_prompt_len: int = _opt(512, "tokens of the system prompt that every session shares")
    user_len: int = _opt(128, "tokens of each user message")
    output_len: int = _opt(128, "tokens of each assistant reply")
    think_time_s: float = _opt(2.0, "seconds between a turn and the session's next one")
    request_rate: float = _opt(
        math.inf, "sessions started per second, Poisson (inf: all at 0)", gt=0
    )
    vocab_size: int = _opt(SIM_VOCAB_SIZE, "token ids are drawn from [0, vocab_size)", ge=3)
    seed: int = _opt(0, "seed of the generator")

    def __post_init__(self) -> None:
        check_fields(self)
        if min(self.num_sessions, self.turns, self.user_len, self.output_len) < 1:
            raise ValueError("num_sessions, turns, user_len and output_len must be >= 1")
        if self.think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")


def multi_turn_chat(cfg: MultiTurnConfig, reply_fn: ReplyFn | None = None) -> list[WorkloadRequest]:
    """Every session's turns, in arrival order; turn k's prompt extends turn k-1's.

    The assistant replies that go into the history are predetermined: random tokens, or
    ``reply_fn(prompt, output_len)`` (pass ``SimRunner.generate`` so that a simulated engine's
    own output matches the history and its cached reply is reused, as in a real chat).
    """
    rng = random.Random(cfg.seed)
    system = _random_ids(rng, cfg.system_prompt_len, cfg.vocab_size)
    starts = poisson_arrivals(cfg.num_sessions, cfg.request_rate, rng)
    out: list[WorkloadRequest] = []
    for s, start in enumerate(starts):
        out += _session(cfg, rng, f"chat-s{s}", start, system, reply_fn)
    out.sort(key=lambda r: r.arrival_s)  # stable: a session's turns keep their order
    return out


def _session(
    cfg: MultiTurnConfig,
    rng: random.Random,
    session: str,
    start: float,
    system: list[int],
    reply_fn: ReplyFn | None,
) -> list[WorkloadRequest]:
    history, prev, turns = list(system), None, []
    for t in range(cfg.turns):
        prompt = history + _random_ids(rng, cfg.user_len, cfg.vocab_size)
        rid = f"{session}-t{t}"
        arrival = start + t * cfg.think_time_s
        turns.append(
            WorkloadRequest(
                rid, arrival, prompt, cfg.output_len, session=session, turn=t, prev_rid=prev
            )
        )
        if reply_fn is None:
            reply = _random_ids(rng, cfg.output_len, cfg.vocab_size)
        else:
            reply = reply_fn(prompt, cfg.output_len)
        history, prev = prompt + reply, rid
    return turns


# --- shared-prefix mix -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefixMixConfig:
    """A stream where each request extends one of a few system prompts with probability
    ``shared_prob`` and is cold (a prompt of its own, as long) otherwise."""

    num_requests: int = _opt(100, "requests in the stream")
    shared_prob: float = _opt(0.9, "probability that a request extends a shared system prompt")
    num_prefixes: int = _opt(8, "shared system prompts, equally popular")
    system_prompt_len: int = _opt(256, "tokens of each system prompt")
    question_len: int = _opt(16, "tokens after the system prompt")
    output_len: int = _opt(8, "tokens to generate per request")
    request_rate: float = _opt(100.0, "Poisson arrivals per second (inf: all at time 0)", gt=0)
    vocab_size: int = _opt(SIM_VOCAB_SIZE, "token ids are drawn from [0, vocab_size)", ge=3)
    seed: int = _opt(0, "seed of the generator")

    def __post_init__(self) -> None:
        check_fields(self)
        if min(self.num_requests, self.num_prefixes, self.system_prompt_len, self.output_len) < 1:
            raise ValueError(
                "num_requests, num_prefixes, system_prompt_len and output_len must be >= 1"
            )
        if self.question_len < 0:
            raise ValueError(f"question_len must be >= 0, got {self.question_len}")
        if not 0 <= self.shared_prob <= 1:
            raise ValueError(f"shared_prob must be in [0, 1], got {self.shared_prob}")


def prefix_mix(cfg: PrefixMixConfig) -> list[WorkloadRequest]:
    """``num_requests`` prompts in arrival order: shared ones are in group ``pN``, cold ones
    have no group. The system prompts are drawn first, so they do not depend on the mix."""
    rng = random.Random(cfg.seed)
    systems = [
        _random_ids(rng, cfg.system_prompt_len, cfg.vocab_size) for _ in range(cfg.num_prefixes)
    ]
    arrivals = poisson_arrivals(cfg.num_requests, cfg.request_rate, rng)
    out = []
    for i, t in enumerate(arrivals):
        shared = rng.random() < cfg.shared_prob
        g = rng.randrange(cfg.num_prefixes)
        head = systems[g] if shared else _random_ids(rng, cfg.system_prompt_len, cfg.vocab_size)
        ids = head + _random_ids(rng, cfg.question_len, cfg.vocab_size)
        out.append(WorkloadRequest(f"mix-{i}", t, ids, cfg.output_len, f"p{g}" if shared else None))
    return out


# --- registry --------------------------------------------------------------------------------

WORKLOADS: dict[str, tuple[type, Callable[[Any], list[WorkloadRequest]]]] = {
    "generated-shared-prefix": (SharedPrefixConfig, generated_shared_prefix),
    "multi-turn": (MultiTurnConfig, multi_turn_chat),
    "shared-prefix-mix": (PrefixMixConfig, prefix_mix),
    "trace": (TraceConfig, trace_replay),
}


def make_workload(name: str, **kwargs: Any) -> list[WorkloadRequest]:
    """Build the named workload from its config's fields (unknown names raise ValueError)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    cls, generate = WORKLOADS[name]
    known = {f.name for f in fields(cls)}
    if unknown := set(kwargs) - known:
        raise ValueError(f"{name}: unknown options {sorted(unknown)}; known: {sorted(known)}")
    return generate(cls(**kwargs))
