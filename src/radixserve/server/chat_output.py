"""Each chat choice's text read as OpenAI's message (content, tool_calls, reasoning_content),
whole or as stream deltas, by the request's tool-call and reasoning parsers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.chat.reasoning import ReasoningParser, reasoning_fields
from radixserve.chat.tool_parsers import ToolParser


@dataclass(frozen=True, slots=True)
class ChatOutput:
    """How one request's choices are read: tool calls (``tools`` None: not parsed) and
    reasoning (``reasoning`` None: all content)."""

    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole message of a choice's text, and its finish reason."""
        msg: dict[str, Any] = {"role": "assistant"}
        if self.reasoning is not None:
            split = self.reasoning.split(text, True)
            msg |= reasoning_fields(split.reasoning or None)
            text = split.content
        if self.tools is None:
            return msg | {"content": text}, finish
        parsed = self.tools.parse(text)
        msg["content"] = parsed.content
        if parsed.calls:
            msg["tool_calls"] = [c.openai() for c in parsed.calls]
        return msg, _finish(finish, bool(parsed.calls))

    def stream(self) -> ChatDeltas:
        return ChatDeltas(self)


class ChatDeltas:
    """One choice's text deltas in, OpenAI chat deltas out."""

    def __init__(self, output: ChatOutput) -> None:
        self._reasoning = output.reasoning.stream() if output.reasoning else None
        self._tools = output.tools.stream() if output.tools else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._content(text, False)
        thought, content = self._reasoning.feed(text)
        return self._thought(thought) + self._content(content, False)

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas held back until the end, and the finish reason to send."""
        out = []
        if self._reasoning is not None:
            thought, content = self._reasoning.finish()
            out = self._thought(thought) + self._content(content, False)
        out += self._content("", True)
        return out, _finish(reason, self._tools is not None and self._tools.called)

    def _thought(self, text: str) -> list[dict[str, Any]]:
        return [reasoning_fields(text)] if text else []

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self._tools is None:
            return [{"content": text}] if text else []
        return self._tools.finish() if final else self._tools.feed(text) if text else []


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason
