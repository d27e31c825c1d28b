"""Workloads as plain request records: shared-prefix groups, multi-turn chat and trace replay.

Also the best prefix hit rate a workload allows, and a deterministic text rendering of token ids.
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from radixserve.config import check_fields
from radixserve.modelfiles.sim_tokenizer import (  # noqa: F401  (re-exported: workloads as text)
    SIM_VOCAB_SIZE,
    parse_text,
    render_text,
)
from radixserve.sim.trace_tokens import TRACE_BLOCK_TOKENS, TraceTokens

ReplyFn = Callable[[list[int], int], list[int]]  # (prompt ids, n) -> the assistant's n tokens


def _opt(default: Any, help: str, **bounds: Any) -> Any:
    return field(default=default, metadata={"help": help, **bounds})


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


# --- trace replay ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One line of a Mooncake-format trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Replay of a JSONL trace: timestamp (ms), input_length, output_length, hash_ids."""

    path: str | None = _opt(None, "the trace file (JSONL)")
    limit: int | None = _opt(None, "replay only the first N requests")
    request_rate: float | None = _opt(None, "Poisson arrivals per second (None: trace times)", gt=0)
    block_tokens: int = _opt(512, "tokens generated per 512-token block (less shrinks prompts)")
    vocab_size: int = _opt(SIM_VOCAB_SIZE, "token ids are drawn from [0, vocab_size - 1)", ge=3)
    seed: int = _opt(0, "seed of the Poisson arrivals")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3, got {self.vocab_size}")
        if not 1 <= self.block_tokens <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"block_tokens must be in [1, 512], got {self.block_tokens}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be >= 0, got {self.limit}")


def read_trace(path: str, limit: int | None = None) -> list[TraceRecord]:
    """Parse a trace file; a malformed line raises ValueError naming the line."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if line.strip():
                records.append(_parse_record(line, f"{path}:{lineno}"))
    return records


def _parse_record(line: str, where: str) -> TraceRecord:
    try:
        d = json.loads(line)
        ids = tuple(int(h) for h in d["hash_ids"])
        rec = TraceRecord(
            float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]), ids
        )
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a trace record: {e}") from None
    n = len(rec.hash_ids)
    if not TRACE_BLOCK_TOKENS * (n - 1) < rec.input_length <= TRACE_BLOCK_TOKENS * n:
        raise ValueError(f"{where}: input_length {rec.input_length} does not fit {n} blocks")
    return rec


def trace_replay(cfg: TraceConfig) -> list[WorkloadRequest]:
    """Requests whose prompts are the trace's blocks: equal hash ids give equal tokens, and two
    prompts share exactly the tokens of their shared leading hash ids (see ``TraceTokens``)."""
    if cfg.path is None:
        raise ValueError("trace replay needs a path")
    records = read_trace(cfg.path, cfg.limit)
    if cfg.request_rate is None:
        arrivals = [r.timestamp_ms / 1000 for r in records]
    else:
        arrivals = poisson_arrivals(len(records), cfg.request_rate, random.Random(cfg.seed))
    tokens = TraceTokens(cfg.block_tokens, cfg.vocab_size)
    return [
        WorkloadRequest(
            f"trace-{i}",
            t,
            tokens.prompt(r.hash_ids, r.input_length),
            r.output_length,
            hash_ids=r.hash_ids,
        )
        for i, (r, t) in enumerate(zip(records, arrivals, strict=True))
    ]


# --- hit rates -------------------------------------------------------------------------------


def ideal_prefix_hit_rate(
    requests: Iterable[WorkloadRequest],
    page_size: int = 1,
    outputs: Callable[[WorkloadRequest], list[int]] | None = None,
) -> float:
    """Share of prompt tokens that one unbounded cache already holds, in arrival order: the
    best any placement can reach.

    A token is a hit when the prompt up to and including it (in whole pages) was a prefix of
    an earlier cached sequence, except a prompt's last token, which an engine always computes.
    Without ``outputs`` only prompts are cached, so multi-turn replies count as misses; with
    it (what the engine generates for a request), each reply but its last token is cached too.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    seen: list[list[int]] = []  # earlier cached sequences, sorted
    hit = total = 0
    for req in sorted(requests, key=lambda r: r.arrival_s):
        ids = req.input_ids
        i = bisect.bisect_left(seen, ids)
        # the earlier sequence sharing the longest prefix is a sorted-order neighbour
        best = max(
            (_common_prefix(ids, seen[j]) for j in (i - 1, i) if 0 <= j < len(seen)), default=0
        )
        best = min(best, len(ids) - 1)
        hit += best - best % page_size
        total += len(ids)
        seen.insert(i, ids)
        if outputs is not None:
            out = outputs(req)
            if len(out) > 1:
                bisect.insort(seen, ids + out[:-1])  # the last token's KV is never computed
    return hit / total if total else 0.0


def _common_prefix(a: list[int], b: list[int]) -> int:
    # binary search on slice equality: the comparisons run in C, not token by token in Python
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def block_hit_rate(requests: Iterable[WorkloadRequest | TraceRecord]) -> float:
    """Share of prompt blocks (hash ids) that an unbounded cache already holds, in order.

    Blocks hit only as a prefix: after a request's first unseen block, the rest are misses.
    """
    seen: set[int] = set()
    hit = total = 0
    for req in requests:
        if not req.hash_ids:
            raise ValueError("block_hit_rate needs requests with hash_ids (trace replay)")
        n = 0
        while n < len(req.hash_ids) and req.hash_ids[n] in seen:
            n += 1
        hit += n
        total += len(req.hash_ids)
        seen.update(req.hash_ids)
    return hit / total if total else 0.0


# --- text ------------------------------------------------------------------------------------

# 16 consonants x 4 vowels: a token id is written as its base-64 digits, one syllable each


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
