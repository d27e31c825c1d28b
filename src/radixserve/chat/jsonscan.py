"""Reading JSON that may still be arriving: where a value ends, whether what came so far can
still become valid JSON, and the top-level members of an object or list. Tool-call parsers use
it to stream a call's arguments as the raw text the model wrote, a prefix of the final string."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WS = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}
_SCALAR_START = set('-0123456789tfn"')
_STRING_BODY = re.compile(r'(?:[^"\\\n]+|\\.)*', re.S)  # up to a closing quote (or the end)
_PLAIN = re.compile(r'[^"{}\[\]]*')  # what a container's scan can skip


class Malformed(ValueError):
    """The text can no longer become the JSON value it was read as."""


def skip_ws(text: str, at: int) -> int:
    while at < len(text) and text[at] in WS:
        at += 1
    return at


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``start`` ends (one past it), or None while it is still
    open. Raises Malformed at a character no JSON value could have there."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in _CLOSE:
        return _container_end(text, start)
    if first not in _SCALAR_START:
        raise Malformed(f"unexpected {first!r}")
    at = start
    while at < len(text) and text[at] not in WS + ",]}":
        at += 1
    if at == len(text):
        return None  # a number or literal may go on
    _check(text[start:at])
    return at


def _string_end(text: str, start: int) -> int | None:
    # regular expressions, not a loop per character: a stream rescans its text at every delta
    at = _STRING_BODY.match(text, start + 1).end()  # type: ignore[union-attr]
    if at >= len(text) or text[at] == "\\":  # open, or an escape cut off
        return None
    if text[at] == "\n":
        raise Malformed("newline in a string")
    return at + 1


def _container_end(text: str, start: int) -> int | None:
    stack = [_CLOSE[text[start]]]
    at = start + 1
    while at < len(text):
        at = _PLAIN.match(text, at).end()  # type: ignore[union-attr]
        if at >= len(text):
            return None
        c = text[at]
        if c == '"':
            end = _string_end(text, at)
            if end is None:
                return None
            at = end
            continue
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in "]}":
            if c != stack.pop():
                raise Malformed(f"unbalanced {c!r}")
            if not stack:
                _check(text[start : at + 1])
                return at + 1
        at += 1
    return None


def _check(raw: str) -> None:
    try:
        json.loads(raw)
    except ValueError as e:
        raise Malformed(str(e)) from None


@dataclass(slots=True)
class Member:
    """One member of an object (``key``) or item of a list (``key`` None) read so far: its raw
    text from ``start``, complete when ``end`` is set."""

    key: str | None
    start: int
    end: int | None

    def raw(self, text: str) -> str:
        return text[self.start : self.end]

    def value(self, text: str) -> object:
        if self.end is None:
            raise Malformed("incomplete")
        return json.loads(text[self.start : self.end])


def members(text: str, start: int) -> tuple[list[Member], int | None]:
    """The members read so far of the object or list opening at ``start``, and where the
    container ends (None while open). Raises Malformed where the text breaks the syntax."""
    is_obj = text[start] == "{"
    out: list[Member] = []
    at = skip_ws(text, start + 1)
    if at < len(text) and text[at] == ("}" if is_obj else "]"):
        return out, at + 1
    while at < len(text):
        key = None
        if is_obj:
            key, at = _key(text, at)
            if key is None:
                return out, None
        end = value_end(text, at) if at < len(text) else None
        out.append(Member(key, at, end))
        if end is None:
            return out, None
        at = skip_ws(text, end)
        if at < len(text):
            if text[at] == ("}" if is_obj else "]"):
                return out, at + 1
            if text[at] != ",":
                raise Malformed(f"unexpected {text[at]!r}")
            at = skip_ws(text, at + 1)
    return out, None


def _key(text: str, at: int) -> tuple[str | None, int]:
    """A member's key and where its value starts; (None, _) while they are still arriving."""
    if text[at] != '"':
        raise Malformed(f"expected a key, got {text[at]!r}")
    end = _string_end(text, at)
    if end is None:
        return None, at
    colon = skip_ws(text, end)
    if colon >= len(text):
        return None, at
    if text[colon] != ":":
        raise Malformed(f"expected ':', got {text[colon]!r}")
    value = skip_ws(text, colon + 1)
    if value >= len(text):
        return None, at
    return json.loads(text[at:end]), value
