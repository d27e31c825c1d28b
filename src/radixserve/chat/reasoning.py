"""Reasoning parsers: a model's thinking (``<think>...</think>``) apart from its answer, whole
and streamed, by SGLang's and vLLM's names. ``qwen3``: thinking only where the output opens
with ``<think>``. ``deepseek-r1``: its template opens the tag, so the output may start inside
the thinking; everything up to ``</think>`` is reasoning (all of it if the tag never closes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.chat.tool_parsers.base import held

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class Split:
    reasoning: str
    content: str


class ReasoningParser:
    """``<think>`` reasoning. ``starts_inside``: the output may begin within the thinking."""

    name = "qwen3"
    starts_inside = False

    def split(self, text: str, final: bool) -> Split:
        """``text`` so far cut into reasoning and content; not ``final``, what may still be a
        tag is held back, so that each part only grows as text arrives."""
        lead = len(text) - len(text.lstrip())
        opened = text.startswith(OPEN, lead)
        if not opened and not final and OPEN.startswith(text[lead:]):
            return Split("", "")  # may still be the opening tag
        if not opened and not self.starts_inside:
            return Split("", text)
        body = lead + len(OPEN) if opened else 0
        end = text.find(CLOSE, body)
        if end < 0:
            keep = 0 if final else held(text[body:], CLOSE)
            return Split(text[body : len(text) - keep], "")
        return Split(text[body:end], text[end + len(CLOSE) :].lstrip())

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek-r1"
    starts_inside = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ReasoningParser,
    "deepseek-r1": DeepSeekR1Parser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise KeyError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()


@dataclass
class ReasoningStream:
    """Text deltas in, (reasoning delta, content delta) out."""

    parser: ReasoningParser
    text: str = ""
    sent: Split = Split("", "")

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._diff(self.parser.split(self.text, False))

    def finish(self) -> tuple[str, str]:
        return self._diff(self.parser.split(self.text, True))

    def _diff(self, now: Split) -> tuple[str, str]:
        before, self.sent = self.sent, now
        return now.reasoning[len(before.reasoning) :], now.content[len(before.content) :]


def reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    """The message (or delta) fields of reasoning text: vLLM's newer ``reasoning`` and the
    ``reasoning_content`` of SGLang and DeepSeek's API."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}
