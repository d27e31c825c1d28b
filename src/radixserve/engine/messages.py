"""Typed messages between the engine's processes (pickled over ZeroMQ).

tokenizer manager -> scheduler: GenerateReq, AbortReq, ControlReq
detokenizer -> scheduler:       StopReq (a stop string was seen)
scheduler -> detokenizer:       OpenStream, TokenBatch, ErrorOut, ControlOut (the last two
                                pass through)
detokenizer -> tokenizer mgr:   TextBatch, ErrorOut, ControlOut
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.sched.batch import TokenLogprob
from radixserve.sched.request import SamplingParams


@dataclass(slots=True)
class GenerateReq:
    rid: str
    input_ids: Sequence[int]  # an array from the tokenizer manager (token_array)
    sampling: SamplingParams
    priority: int = 0
    routing_key: str | None = None
    namespace: str | None = None
    # disaggregation: the room pairing this request's prefill and decode halves; on a decode
    # engine also the prefill engine's scheduler endpoint (looked up on its bootstrap server)
    bootstrap_room: int | None = None
    prefill_endpoint: str | None = None
    # --enable-trace: the W3C traceparent of the HTTP request's span; the scheduler's spans
    # (queue, prefill, decode) are its children
    trace: str | None = None


@dataclass(slots=True)
class KVDest:
    """Decode -> prefill engine: where a room's prompt KV goes (Mooncake session, the pool's
    layout, the reserved slots) and where to say it has landed."""

    room: int
    session: str
    layout: Any  # kvstore.pd_transfer.PoolLayout
    slots: list[int]  # for the prompt's positions from ``skip`` on
    reply: str  # the decode scheduler's endpoint for KVDone
    skip: int = 0  # prompt positions whose KV the decode engine holds already (its tree's)


@dataclass(slots=True)
class KVDone:
    """Prefill -> decode engine: the room's pages are written (``error`` None) with the first
    token the prefill sampled, or they never will be (``error`` says why)."""

    room: int
    first_token: int | None
    error: str | None = None
    logprob: TokenLogprob | None = None


@dataclass(slots=True)
class KVCancel:
    """Decode -> prefill engine: the room's request ended here; write nothing into its slots."""

    room: int


@dataclass(slots=True)
class KVSent:
    """Prefill engine's sender thread -> its own scheduler: a request's pages are written
    (``error`` None) or failed; its slots may be released."""

    rid: str
    error: str | None = None


@dataclass(slots=True)
class AbortReq:
    rid: str


@dataclass(slots=True)
class StopReq:
    rid: str


@dataclass(slots=True)
class CloseStream:
    """Scheduler -> detokenizer: an aborted or stopped request gets no more tokens."""

    rid: str


@dataclass(slots=True)
class ControlReq:
    """A request to the scheduler process that gets one ControlOut back (flush_cache, stats,
    update_scheduler_settings with its ``args``)."""

    req_id: str
    op: str
    args: dict[str, Any] | None = None


@dataclass(slots=True)
class ControlOut:
    req_id: str
    result: Any


@dataclass(slots=True)
class ErrorOut:
    """The request could not run; ``code`` is the HTTP status the client should see."""

    rid: str
    message: str
    code: int = 400
    param: str | None = None  # the request field at fault, when one is


@dataclass(slots=True)
class OpenStream:
    """Sent to the detokenizer before a request's first tokens: the stop strings to watch."""

    rid: str
    stop: tuple[str, ...]
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep a matched stop string in the text
    min_new_tokens: int = 0  # stop strings count only from this many tokens on


@dataclass(slots=True)
class TokenOut:
    rid: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    matched_stop: int | str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    # logprobs of the prompt tokens at positions prompt_logprob_start.. (first output only)
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprob_start: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, loaded from the host tier
    storage_cached_tokens: int = 0  # of cached_tokens, loaded from the storage tier


@dataclass(slots=True)
class TokenBatch:
    outputs: list[TokenOut]


@dataclass(slots=True)
class TextOut:
    rid: str
    text: str  # the new text since the last TextOut of this request
    token_ids: list[int]  # the new token ids
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    matched_stop: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprob_start: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, loaded from the host tier
    storage_cached_tokens: int = 0  # of cached_tokens, loaded from the storage tier


@dataclass(slots=True)
class TextBatch:
    outputs: list[TextOut]


def cached_details(total: int, host: int, storage: int = 0) -> dict[str, int]:
    """Cached prompt tokens by the KV tier they came from (``total`` is their sum)."""
    return {"device": total - host - storage, "host": host, "storage": storage}
