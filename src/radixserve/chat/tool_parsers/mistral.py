"""Mistral's format (Mistral 7B v0.3, Mixtral, Mistral Nemo/Small): ``[TOOL_CALLS]`` and then
the calls as one JSON list of ``{"name", "arguments"}`` objects."""

from __future__ import annotations

import json
from typing import Any

from radixserve.chat.calls import Piece
from radixserve.chat.tool_parsers.base import ToolParser
from radixserve.chat.tool_parsers.json_calls import many_calls, sections
from radixserve.chat.tool_parsers.schemas import call_schema, json_list, one_of


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    special_start = True

    def scan(self, text: str, final: bool) -> list[Piece]:
        return sections(text, final, self.start, None, many_calls(("arguments",)))

    def render(self, calls: list[dict[str, Any]]) -> str:
        return self.start + json.dumps(calls, ensure_ascii=False)

    def constrained(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        return json_list(self.start, one_of([call_schema(t) for t in tools]), "", parallel)
