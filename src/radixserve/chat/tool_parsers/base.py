"""The base of every tool-call format and the one streaming state machine they all share.

A format implements ``scan(text, final)``: the model's text so far cut into content and calls
(``Text`` / ``Call`` pieces). Two rules make streaming exact: a piece never shrinks as text
arrives (a call's ``args`` only grows), and text that might still turn into a call is held back
until ``final``. ``ToolStream`` then only diffs one scan against the last, so the deltas it emits
add up to what ``parse`` returns for the whole text; no format has streaming code of its own.
A call found malformed becomes text; a stream that already sent its start sends the rest as
content (the only case where a stream and a whole parse differ).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixserve.chat.calls import Call, Parsed, Piece, ToolCall, content_of, new_call_id


class ToolParser(ABC):
    """One tool-call format. Subclasses set ``name`` and implement ``scan`` and ``render``."""

    name: ClassVar[str]
    start: ClassVar[str]  # the text that opens the calls (for detect and the default prompt)
    # the opener is a special token in its models' vocabularies, which the text keeps only
    # when special tokens are not skipped
    special_start: ClassVar[bool] = False

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # 1 when the request sets parallel_tool_calls false

    @abstractmethod
    def scan(self, text: str, final: bool) -> list[Piece]:
        """``text`` cut into pieces. Not ``final``: hold back what may still open a call."""

    @abstractmethod
    def render(self, calls: list[dict[str, Any]]) -> str:
        """The text this format's model writes for ``calls`` ({"name", "arguments": dict}):
        how a past assistant turn is written where the chat template knows no tools."""

    def constrained(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """An xgrammar structural-tag format admitting only calls to ``tools`` in this format
        (at least one; one only unless ``parallel``), or None where it cannot be written."""
        return None

    def detect(self, text: str) -> bool:
        """Whether ``text`` holds a tool call of this format."""
        return any(isinstance(p, Call) for p in self.scan(text, True))

    def parse(self, text: str) -> Parsed:
        """The whole output's content and complete tool calls."""
        pieces = self._limited(self.scan(text, True))
        calls = [ToolCall(new_call_id(), p.name or "", p.args) for p in pieces
                 if isinstance(p, Call)]  # fmt: skip
        return Parsed(content_of(pieces, True) or None, calls)

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def _limited(self, pieces: list[Piece]) -> list[Piece]:
        if self.max_calls is None:
            return pieces
        out, calls = [], 0
        for p in pieces:
            calls += isinstance(p, Call)
            if not isinstance(p, Call) or calls <= self.max_calls:
                out.append(p)
        return out


@dataclass
class _Sent:
    id: str
    name: str
    args: str = ""


@dataclass
class ToolStream:
    """Turns text deltas into OpenAI chat deltas: ``{"content": ...}`` and
    ``{"tool_calls": [{index, id, type, function: {name, arguments}}]}``, then argument
    fragments ``{"tool_calls": [{index, function: {arguments}}]}``."""

    parser: ToolParser
    text: str = ""
    content: str = ""  # content sent so far
    sent: list[_Sent] = field(default_factory=list)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        return self._diff(self.parser.scan(self.text, False), False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what was held back, once the output has ended."""
        return self._diff(self.parser.scan(self.text, True), True)

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def _diff(self, pieces: list[Piece], final: bool) -> list[dict[str, Any]]:
        pieces = self.parser._limited(pieces)
        out = []
        content = content_of(pieces, final)
        if content.startswith(self.content) and len(content) > len(self.content):
            out.append({"content": content[len(self.content) :]})
            self.content = content
        calls = [p for p in pieces if isinstance(p, Call)]
        for i, call in enumerate(calls):
            out += self._call_delta(i, call)
        return out

    def _call_delta(self, i: int, call: Call) -> list[dict[str, Any]]:
        if call.name is None or not (call.args or call.done) or i > len(self.sent):
            return []  # the name goes out once the arguments have begun well
        out = []
        if i == len(self.sent):
            self.sent.append(_Sent(new_call_id(), call.name))
            head = {"index": i, "id": self.sent[i].id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}  # fmt: skip
            out.append({"tool_calls": [head]})
        s = self.sent[i]
        if call.args.startswith(s.args) and len(call.args) > len(s.args):
            fragment = call.args[len(s.args) :]
            s.args = call.args
            out.append({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]})
        return out


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
