"""Replay of a Mooncake-format trace (JSONL: timestamp in ms, input_length, output_length,
hash_ids): reading and checking its records, and the requests whose prompts share what the ids share."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import check_fields
from radixserve.modelfiles.sim_tokenizer import SIM_VOCAB_SIZE
from radixserve.sim.trace_tokens import TRACE_BLOCK_TOKENS, TraceTokens
from radixserve.sim.workload_request import WorkloadRequest, poisson_arrivals


def _opt(default: Any, help: str, **bounds: Any) -> Any:
    return field(default=default, metadata={"help": help, **bounds})


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
