"""Response bodies and server-sent-event chunks of the OpenAI-compatible and SGLang endpoints,
built from the engine's ``TextOut`` deltas gathered per choice."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from radixserve.engine.messages import TextOut, cached_details
from radixserve.sched.batch import TokenLogprob
from radixserve.server.chat_output import ChatOutput
from radixserve.server.logprobs import (
    TokenText,
    chat_content,
    completion_logprobs,
    prompt_entries,
)

DONE = b"data: [DONE]\n\n"
SEP = (",", ":")


def dumps(payload: Any) -> bytes:
    """JSON in UTF-8. A string from a client (a rid, a stop string) may hold a lone surrogate,
    which UTF-8 cannot carry: then every non-ASCII character is escaped instead."""
    try:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=SEP).encode()
    except UnicodeEncodeError:
        return json.dumps(payload, allow_nan=False, separators=SEP).encode()


def sse(payload: Any) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


class JSONBody(JSONResponse):
    """The server's JSON responses, encoded by ``dumps``."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


@dataclass(slots=True)
class Choice:
    """Everything one generation (one prompt, one of its ``n`` samples) has produced so far."""

    index: int
    parts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    last: TextOut | None = None
    started: float = field(default_factory=time.perf_counter)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of ids, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprob_start: int = 0
    prompt_ids: list[int] = field(default_factory=list)  # set where an echo or logprobs need it
    echo: str = ""  # the prompt text, for a completion with echo
    text_offset: int = 0  # completions logprobs, streamed: where the next token's text starts

    def add(self, out: TextOut) -> None:
        self.parts.append(out.text)
        self.ids.extend(out.token_ids)
        self.last = out
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs:
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_logprob_start = out.prompt_logprob_start

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def finish_reason(self) -> str | None:
        return self.last.finish_reason if self.last and self.last.finished else None

    def count(self, name: str) -> int:
        return int(getattr(self.last, name, 0) or 0)


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """OpenAI usage; a prompt sampled ``n`` times counts once, as OpenAI counts it."""
    firsts = [c for c in choices if c.index % n == 0]
    prompt = sum(c.count("prompt_tokens") for c in firsts)
    cached = sum(c.count("cached_tokens") for c in firsts)
    host = sum(c.count("host_cached_tokens") for c in firsts)
    storage = sum(c.count("storage_cached_tokens") for c in firsts)
    completion = sum(c.count("completion_tokens") for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": cached,
            "cached_tokens_details": cached_details(cached, host, storage),
        },
    }


@dataclass(frozen=True, slots=True)
class Head:
    """The fields every body and chunk of one OpenAI response share."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0
    token_text: TokenText | None = None  # set when the client asked for logprobs
    visible_text: TokenText | None = None  # a token's share of the text (no special tokens)
    output: ChatOutput | None = None  # a chat's tool-call and reasoning parsers

    @classmethod
    def new(
        cls, chat: bool, model: str, token_text: TokenText | None = None,
        visible_text: TokenText | None = None,
    ) -> Head:  # fmt: skip
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, model, prefix + uuid.uuid4().hex, int(time.time()), token_text,
                   visible_text)  # fmt: skip

    def _top(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, choices: list[Choice], n: int) -> dict[str, Any]:
        """The whole non-streamed response."""
        out = self._top("chat.completion" if self.chat else "text_completion")
        out["choices"] = [self._choice(c) for c in choices]
        out["usage"] = usage(choices, n)
        return out

    def _choice(self, c: Choice) -> dict[str, Any]:
        lps = self.logprobs(c, c.logprobs, c.ids, echo=True)
        base = {"index": c.index, "logprobs": lps, "finish_reason": c.finish_reason}
        if self.chat:
            output = self.output or ChatOutput()
            message, base["finish_reason"] = output.message(c.text, c.finish_reason)
            return {**base, "message": message}
        return {**base, "text": c.echo + c.text}

    def logprobs(
        self, c: Choice, lps: list[TokenLogprob], ids: list[int], echo: bool, offset: int = 0
    ) -> dict[str, Any] | None:
        """The ``logprobs`` of tokens ``ids`` (of the prompt too for an ``echo``ed completion
        whose prompt logprobs came, with ``offset`` where the tokens' text starts)."""
        if self.token_text is None:
            return None
        if self.chat:
            return chat_content(lps, self.token_text)
        all_ids, all_lps = list(ids), list[TokenLogprob | None](lps)
        if echo and c.echo:
            p_ids, p_lps = prompt_entries(c.prompt_ids, 0, c.prompt_logprobs,
                                          c.prompt_logprob_start)  # fmt: skip
            all_ids, all_lps = p_ids + all_ids, p_lps + all_lps
        visible = self.visible_text
        return completion_logprobs(all_lps, self.token_text, all_ids, offset, visible)

    def visible(self, token: int) -> str:
        return (self.visible_text or self.token_text or str)(token)

    def chunk(
        self, index: int, delta: dict[str, Any] | str, finish: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One streamed chunk: ``delta`` is the chat delta or the completion text."""
        out = self._top("chat.completion.chunk" if self.chat else "text_completion")
        item = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        item["delta" if self.chat else "text"] = delta
        out["choices"] = [item]
        return out

    def usage_chunk(self, choices: list[Choice], n: int) -> dict[str, Any]:
        out = self._top("chat.completion.chunk" if self.chat else "text_completion")
        return {**out, "choices": [], "usage": usage(choices, n)}


def meta_info(c: Choice) -> dict[str, Any]:
    """SGLang's meta_info: token counts, why it finished, and its latency so far."""
    last, reason = c.last, c.finish_reason
    finish: dict[str, Any] | None = None
    if reason == "length":
        finish = {"type": "length", "length": c.count("completion_tokens")}
    elif reason is not None:
        finish = {"type": reason, "matched": last.matched_stop if last else None}
    return {
        "id": last.rid if last else None,
        "finish_reason": finish,
        "prompt_tokens": c.count("prompt_tokens"),
        "completion_tokens": c.count("completion_tokens"),
        "cached_tokens": c.count("cached_tokens"),
        "cached_tokens_details": cached_details(
            c.count("cached_tokens"),
            c.count("host_cached_tokens"),
            c.count("storage_cached_tokens"),
        ),  # fmt: skip
        "e2e_latency": round(time.perf_counter() - c.started, 6),
    }


def generate_body(c: Choice, batch: bool) -> dict[str, Any]:
    """One /generate result; streamed chunks carry the text so far, as SGLang's do."""
    out = {"text": c.text, "output_ids": list(c.ids), "meta_info": meta_info(c)}
    if batch:
        out["index"] = c.index
    return out
