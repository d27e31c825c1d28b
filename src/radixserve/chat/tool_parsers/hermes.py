"""Hermes' format (Qwen2.5, Qwen3, Hermes 2/3, NousResearch's): each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``."""

from __future__ import annotations

import json
from typing import Any

from radixserve.chat.calls import Piece
from radixserve.chat.tool_parsers.base import ToolParser
from radixserve.chat.tool_parsers.json_calls import one_call, sections
from radixserve.chat.tool_parsers.schemas import call_schema, one_of, tagged


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def scan(self, text: str, final: bool) -> list[Piece]:
        return sections(text, final, self.start, self.end, one_call(("arguments",)))

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.start}\n{json.dumps(c, ensure_ascii=False)}\n{self.end}"
                         for c in calls)  # fmt: skip

    def constrained(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        tag = tagged(self.start + "\n", one_of([call_schema(t) for t in tools]), "\n" + self.end)
        return {"type": "tags_with_separator", "tags": [tag], "separator": "\n",
                "at_least_one": True, "stop_after_first": not parallel}  # fmt: skip
