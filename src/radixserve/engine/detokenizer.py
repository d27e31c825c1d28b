"""Incremental detokenization and stop strings: token ids in, text deltas out.

A delta never ends inside a UTF-8 character, and never shows the start of a stop string
before it is known not to be one. ``run_detokenizer`` is the process loop around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.engine.messages import (
    CloseStream,
    ErrorOut,
    OpenStream,
    StopReq,
    TextBatch,
    TextOut,
    TokenBatch,
    TokenOut,
)
from radixserve.engine.procutil import Endpoints, exit_with_parent
from radixserve.engine.tokenizer_spec import TokenizerSpec

Decode = Callable[[Sequence[int]], str]
# How many already-emitted tokens to decode again as context: enough for a tokenizer to merge
# a leading space or a multi-token character correctly.
CONTEXT_TOKENS = 6


@dataclass(slots=True)
class _Stream:
    stop: tuple[str, ...]
    decode: Decode
    no_stop_trim: bool = False
    min_new_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # ids[prefix_offset:read_offset] is context already turned into text
    read_offset: int = 0
    text: str = ""  # all text decoded so far
    sent: int = 0  # len of text already sent to the client
    stopped: bool = False


class IncrementalDetokenizer:
    """Per-request incremental decoding with stop-string handling."""

    def __init__(self, decode: Decode, decode_special: Decode | None = None) -> None:
        self.decode = decode  # leaves special tokens out
        self.decode_special = decode_special or decode  # keeps them (skip_special_tokens off)
        self.streams: dict[str, _Stream] = {}

    def open(
        self, rid: str, stop: Sequence[str] = (), skip_special_tokens: bool = True,
        no_stop_trim: bool = False, min_new_tokens: int = 0,
    ) -> None:  # fmt: skip
        decode = self.decode if skip_special_tokens else self.decode_special
        stops = tuple(s for s in stop if s)
        self.streams[rid] = _Stream(stops, decode, no_stop_trim, min_new_tokens)

    def feed(self, out: TokenOut) -> TextOut | None:
        """Turn a TokenOut into a TextOut; None once the request stopped on a string or was
        closed (its stream is opened before its first token, on the same socket)."""
        st = self.streams.get(out.rid)
        if st is None or st.stopped:
            return None
        # a matched stop token id leaves no text, unless asked for (vLLM's and SGLang's rule)
        trim = isinstance(out.matched_stop, int) and not st.no_stop_trim
        st.ids.extend(out.token_ids[:-1] if trim else out.token_ids)
        self._decode_new(st, final=out.finished)
        finished, reason, matched = out.finished, out.finish_reason, out.matched_stop
        stop_at = self._find_stop(st) if out.completion_tokens >= st.min_new_tokens else None
        if stop_at is not None:
            end = stop_at[0] + (len(stop_at[1]) if st.no_stop_trim else 0)
            st.text, st.stopped = st.text[:end], True
            finished, reason, matched = True, "stop", stop_at[1]
        end = len(st.text) if finished else len(st.text) - self._held_back(st)
        delta, st.sent = st.text[st.sent : end], max(st.sent, end)
        if finished and not st.stopped:
            del self.streams[out.rid]
        return TextOut(
            out.rid, delta, list(out.token_ids), finished, reason, out.prompt_tokens,
            out.cached_tokens, out.completion_tokens, matched, out.logprobs,
            out.prompt_logprobs, out.prompt_logprob_start, out.host_cached_tokens,
            out.storage_cached_tokens,
        )  # fmt: skip

    def close(self, rid: str) -> None:
        """Forget a request: it failed, was aborted, or stopped on a string and the scheduler
        has sent its last token (a stopped stream is kept until then to drop the rest)."""
        self.streams.pop(rid, None)

    def _decode_new(self, st: _Stream, final: bool) -> None:
        prefix = st.decode(st.ids[st.prefix_offset : st.read_offset])
        full = st.decode(st.ids[st.prefix_offset :])
        # an incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token to complete it
        if full.endswith("\ufffd") and not final:
            return
        if len(full) > len(prefix):
            st.text += full[len(prefix) :]
        st.prefix_offset = max(st.prefix_offset, len(st.ids) - CONTEXT_TOKENS)
        st.read_offset = len(st.ids)

    def _find_stop(self, st: _Stream) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in st.stop:
            i = st.text.find(s, max(0, st.sent - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_back(self, st: _Stream) -> int:
        """Characters at the end of the text that could be the start of a stop string."""
        held = 0
        for s in st.stop:
            for k in range(min(len(s) - 1, len(st.text)), held, -1):
                if st.text.endswith(s[:k]):
                    held = k
                    break
        return held


def run_detokenizer(tokenizer_spec: TokenizerSpec, endpoints: Endpoints, parent_pid: int) -> None:
    """Process loop: TokenBatch in from the scheduler, TextBatch out to the API process; a stop
    string found here is reported back to the scheduler so it stops computing the request."""
    exit_with_parent(parent_pid)
    tokenizer = tokenizer_spec.load()
    detok = IncrementalDetokenizer(
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoints.detok)
    to_tm = ctx.socket(zmq.PUSH)
    to_tm.connect(endpoints.tm)
    to_sched = ctx.socket(zmq.PUSH)
    to_sched.connect(endpoints.sched)
    while True:
        msg = pull.recv_pyobj()
        if isinstance(msg, OpenStream):
            detok.open(msg.rid, msg.stop, msg.skip_special_tokens, msg.no_stop_trim,
                       msg.min_new_tokens)  # fmt: skip
        elif isinstance(msg, TokenBatch):
            texts = _detokenize(detok, msg, to_sched)
            if texts:
                to_tm.send_pyobj(TextBatch(texts))
        elif isinstance(msg, CloseStream):
            detok.close(msg.rid)
        else:  # ErrorOut, ControlOut: for the API process
            if isinstance(msg, ErrorOut):
                detok.close(msg.rid)
            to_tm.send_pyobj(msg)


def _detokenize(detok: IncrementalDetokenizer, batch: TokenBatch, to_sched: Any) -> list[TextOut]:
    texts = []
    for out in batch.outputs:
        text = detok.feed(out)
        if text is None:
            continue
        if text.finished and not out.finished:  # finished here, on a stop string
            to_sched.send_pyobj(StopReq(out.rid))
        texts.append(text)
    return texts
