"""The wire formats `radixserve bench` speaks: OpenAI completions and chat completions, and
SGLang's /generate. Each builds a streaming request and reads one server-sent event back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Event:
    """What one streamed event carried: new text (a token, or a few), and usage if reported."""

    text: str = ""
    done: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


class Backend:
    """Builds the body of a streaming request and parses the events of its response."""

    path = ""

    def body(self, prompt: str, max_tokens: int, model: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, obj: dict[str, Any]) -> Event:
        raise NotImplementedError


def _usage(ev: Event, usage: dict[str, Any] | None) -> Event:
    if usage:
        ev.prompt_tokens = usage.get("prompt_tokens")
        ev.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        ev.cached_tokens = details.get("cached_tokens")
    return ev


class OpenAICompletions(Backend):
    path = "/v1/completions"

    def body(self, prompt: str, max_tokens: int, model: str | None) -> dict[str, Any]:
        return {
            "model": model or "default",  # servers that serve one model ignore the name
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # SGLang and vLLM honour it, so outputs have the asked length
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def parse(self, obj: dict[str, Any]) -> Event:
        choices = obj.get("choices") or []
        text = "".join(c.get("text") or "" for c in choices)
        done = any(c.get("finish_reason") for c in choices)
        return _usage(Event(text, done), obj.get("usage"))


class OpenAIChat(OpenAICompletions):
    path = "/v1/chat/completions"

    def body(self, prompt: str, max_tokens: int, model: str | None) -> dict[str, Any]:
        body = super().body(prompt, max_tokens, model)
        del body["prompt"]
        body["messages"] = [{"role": "user", "content": prompt}]
        return body

    def parse(self, obj: dict[str, Any]) -> Event:
        choices = obj.get("choices") or []
        text = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
        done = any(c.get("finish_reason") for c in choices)
        return _usage(Event(text, done), obj.get("usage"))


class SGLangGenerate(Backend):
    """/generate streams the whole text so far in each event; the new part is the difference."""

    path = "/generate"

    def body(self, prompt: str, max_tokens: int, model: str | None) -> dict[str, Any]:
        params = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        return {"text": prompt, "sampling_params": params, "stream": True}

    def parse(self, obj: dict[str, Any]) -> Event:
        meta = obj.get("meta_info") or {}
        ev = Event(obj.get("text") or "", bool(meta.get("finish_reason")))
        ev.prompt_tokens = meta.get("prompt_tokens")
        ev.completion_tokens = meta.get("completion_tokens")
        ev.cached_tokens = meta.get("cached_tokens")
        return ev


BACKENDS: dict[str, type[Backend]] = {
    "openai": OpenAICompletions,
    "openai-chat": OpenAIChat,
    "sglang": SGLangGenerate,
}


def parse_sse_line(line: str) -> dict[str, Any] | None | str:
    """The JSON object of a ``data:`` line, ``"[DONE]"``, or None for anything else."""
    import json

    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
