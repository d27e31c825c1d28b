"""Llama 3.1/3.2's JSON format: the whole answer is ``{"name": ..., "parameters": {...}}``
(``arguments`` accepted too), optionally after ``<|python_tag|>``, several separated by ``;``.
Text that does not start so is content."""

from __future__ import annotations

import json
from typing import Any

from radixserve.chat.calls import Call, Piece, Text
from radixserve.chat.jsonscan import Malformed, skip_ws
from radixserve.chat.tool_parsers.base import ToolParser
from radixserve.chat.tool_parsers.json_calls import object_call
from radixserve.chat.tool_parsers.schemas import call_schema, one_of

ARGS = ("parameters", "arguments")


class Llama3Parser(ToolParser):
    name = "llama3"
    start = "<|python_tag|>"
    special_start = True

    def scan(self, text: str, final: bool) -> list[Piece]:
        at = skip_ws(text, 0)
        if text.startswith(self.start, at):
            at = skip_ws(text, at + len(self.start))
        elif not final and self.start.startswith(text[at:]) and text[at:]:
            return []  # may be the tag
        if at >= len(text):
            return [] if not final or not text else [Text(text)]
        if text[at] != "{":
            return [Text(text)]
        try:
            return list(self._calls(text, at, final))
        except Malformed:
            return [Text(text)]

    def _calls(self, text: str, at: int, final: bool) -> list[Call]:
        calls = []
        while True:
            call, end = object_call(text, at, ARGS)
            calls.append(call)
            if end is None:
                if final:
                    raise Malformed("the output ended inside a call")
                return calls
            at = skip_ws(text, end)
            if at < len(text) and text[at] == ";":
                at = skip_ws(text, at + 1)
            elif at < len(text):
                raise Malformed(f"text after a call: {text[at : at + 20]!r}")
            if at >= len(text):
                return calls

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]},
                                    ensure_ascii=False) for c in calls)  # fmt: skip

    def constrained(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        # one call: a JSON object is the whole answer, so there is no tag to repeat
        schema = one_of([call_schema(t, "parameters") for t in tools])
        return {"type": "json_schema", "json_schema": schema}
