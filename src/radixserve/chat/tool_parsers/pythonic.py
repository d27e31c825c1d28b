"""The pythonic format (Llama 3.2 / 4, ToolACE): the whole answer is a Python list of calls
with keyword arguments, ``[get_weather(city="Paris"), add(a=1, b=2)]``. A call's arguments go
out, as JSON, once its closing parenthesis has come."""

from __future__ import annotations

import ast
import re
from typing import Any

from radixserve.chat.calls import Call, Piece, Text, args_json
from radixserve.chat.jsonscan import Malformed, skip_ws
from radixserve.chat.tool_parsers.base import ToolParser

NAME = re.compile(r"[A-Za-z_][\w.]*")
_CLOSE = {"(": ")", "[": "]", "{": "}"}


class PythonicParser(ToolParser):
    name = "pythonic"
    start = "["

    def scan(self, text: str, final: bool) -> list[Piece]:
        at = skip_ws(text, 0)
        if at >= len(text):
            return [Text(text)] if final and text else []
        if text[at] != "[":
            return [Text(text)]
        try:
            calls, end = self._calls(text, at + 1, final)
        except Malformed:
            return [Text(text)]
        rest = text[end:] if end is not None else ""
        return [*calls, Text(rest)] if rest.strip() else calls

    def _calls(self, text: str, at: int, final: bool) -> tuple[list[Call], int | None]:
        calls: list[Call] = []
        while True:
            at = skip_ws(text, at)
            if at < len(text) and text[at] == "]" and not calls:
                raise Malformed("an empty list is no call")
            m = NAME.match(text, at)
            if m is None or m.end() == len(text):
                return self._open(calls, final, at == len(text) or m is not None)
            if text[m.end()] != "(":
                raise Malformed("expected a call")
            close = _matching(text, m.end())
            if close is None:
                return self._open([*calls, Call(m.group(), "", False)], final, True)
            calls.append(Call(m.group(), _arguments(text[at : close + 1]), True))
            at = skip_ws(text, close + 1)
            if at == len(text):
                return self._open(calls, final, True)
            if text[at] == "]":
                return calls, at + 1
            if text[at] != ",":
                raise Malformed("expected , or ]")
            at += 1

    @staticmethod
    def _open(calls: list[Call], final: bool, may_go_on: bool) -> tuple[list[Call], None]:
        if final or not may_go_on:
            raise Malformed("the output ended inside the list")
        return calls, None

    def render(self, calls: list[dict[str, Any]]) -> str:
        def one(c: dict[str, Any]) -> str:
            args = ", ".join(f"{k}={v!r}" for k, v in c["arguments"].items())
            return f"{c['name']}({args})"

        return "[" + ", ".join(one(c) for c in calls) + "]"


def _matching(text: str, opening: int) -> int | None:
    """Where the bracket at ``opening`` closes (Python strings skipped), None while open."""
    stack, at, quote = [], opening, ""
    while at < len(text):
        c = text[at]
        if quote:
            at += 2 if c == "\\" else 1
            quote = "" if c == quote else quote
            continue
        if c in "'\"":
            quote = c
        elif c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in ")]}":
            if not stack or c != stack.pop():
                raise Malformed(f"unbalanced {c!r}")
            if not stack:
                return at
        at += 1
    return None


def _arguments(source: str) -> str:
    """The keyword arguments of one call's source as JSON text."""
    try:
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise Malformed("a call takes keyword arguments only")
        return args_json({k.arg: ast.literal_eval(k.value) for k in node.keywords})
    except (SyntaxError, ValueError, TypeError) as e:
        raise Malformed(str(e)) from None
