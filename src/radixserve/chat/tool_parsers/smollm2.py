"""SmolLM2-Instruct's format: the calls as one JSON list of ``{"name", "arguments"}`` objects
between ``<tool_call>`` and ``</tool_call>`` (an empty list: no call). SmolLM2 was tuned for
function calling on this form (its model card's prompt), so the default tools prompt of a
template that knows no tools asks for it, and the built-in model answers in it."""

from __future__ import annotations

import json
from typing import Any

from radixserve.chat.calls import Piece
from radixserve.chat.tool_parsers.base import ToolParser
from radixserve.chat.tool_parsers.json_calls import many_calls, sections
from radixserve.chat.tool_parsers.schemas import call_schema, json_list, one_of


class SmolLM2Parser(ToolParser):
    name = "smollm2"
    start = "<tool_call>"
    end = "</tool_call>"

    def scan(self, text: str, final: bool) -> list[Piece]:
        return sections(text, final, self.start, self.end, many_calls(("arguments",)))

    def render(self, calls: list[dict[str, Any]]) -> str:
        return f"{self.start}{json.dumps(calls, ensure_ascii=False)}{self.end}"

    def constrained(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        return json_list(self.start, one_of([call_schema(t) for t in tools]), self.end, parallel)
