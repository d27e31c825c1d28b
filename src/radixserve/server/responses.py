"""Response bodies and server-sent-event chunks of the OpenAI-compatible and SGLang endpoints,
built from the engine's ``TextOut`` deltas gathered per choice."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from radixserve.engine.messages import TextOut

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

    def add(self, out: TextOut) -> None:
        self.parts.append(out.text)
        self.ids.extend(out.token_ids)
        self.last = out

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
    completion = sum(c.count("completion_tokens") for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.count("cached_tokens") for c in firsts)},
    }


@dataclass(frozen=True, slots=True)
class Head:
    """The fields every body and chunk of one OpenAI response share."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    @classmethod
    def new(cls, chat: bool, model: str) -> Head:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, model, prefix + uuid.uuid4().hex, int(time.time()))

    def _top(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, choices: list[Choice], n: int) -> dict[str, Any]:
        """The whole non-streamed response."""
        out = self._top("chat.completion" if self.chat else "text_completion")
        out["choices"] = [self._choice(c) for c in choices]
        out["usage"] = usage(choices, n)
        return out

    def _choice(self, c: Choice) -> dict[str, Any]:
        base = {"index": c.index, "logprobs": None, "finish_reason": c.finish_reason}
        if self.chat:
            return {**base, "message": {"role": "assistant", "content": c.text}}
        return {**base, "text": c.text}

    def chunk(self, index: int, delta: dict[str, Any] | str, finish: str | None) -> dict[str, Any]:
        """One streamed chunk: ``delta`` is the chat delta or the completion text."""
        out = self._top("chat.completion.chunk" if self.chat else "text_completion")
        item = {"index": index, "logprobs": None, "finish_reason": finish}
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
        "e2e_latency": round(time.perf_counter() - c.started, 6),
    }


def generate_body(c: Choice, batch: bool) -> dict[str, Any]:
    """One /generate result; streamed chunks carry the text so far, as SGLang's do."""
    out = {"text": c.text, "output_ids": list(c.ids), "meta_info": meta_info(c)}
    if batch:
        out["index"] = c.index
    return out
