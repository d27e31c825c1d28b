"""What a tool-call parser finds in a model's text, and how it goes out in OpenAI's shape: tool
calls with ids (``call_<random>``), a name and the arguments as a JSON string."""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An id in OpenAI's form: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(frozen=True, slots=True)
class Text:
    """Text of the output that is not a tool call (the message's content)."""

    text: str


@dataclass(frozen=True, slots=True)
class Call:
    """A tool call read so far: ``name`` None until it is known; ``args`` the arguments' JSON
    text so far, always a prefix of the final text; ``done`` once the call is complete."""

    name: str | None
    args: str
    done: bool


Piece = Text | Call


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Parsed:
    """A whole output: its content (None when there is none) and its tool calls."""

    content: str | None
    calls: list[ToolCall]


def args_json(value: Any) -> str:
    """Arguments written by the model as a value (not JSON text) in the one JSON form used."""
    return json.dumps(value, ensure_ascii=False)


def content_of(pieces: list[Piece], final: bool) -> str:
    """The content that ``pieces`` carry: the text around the calls, less whitespace between,
    after or before calls. Not ``final``, trailing whitespace is held back (a call may follow).
    Both rules keep the content of a growing text growing only at its end."""
    out: list[str] = []
    first_call = None
    for p in pieces:
        if isinstance(p, Call):
            first_call = len(out) if first_call is None else first_call
        elif first_call is None or p.text.strip():
            out.append(p.text)
    content = "".join(out)
    if first_call is not None and not "".join(out[:first_call]).strip():
        content = content.lstrip()  # nothing came before the calls: none was sent yet either
    return content.rstrip() if first_call is not None or not final else content
