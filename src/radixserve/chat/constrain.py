"""Constrained decoding of tool calls: for ``tool_choice`` "required" or a named function, an
xgrammar structural tag that admits only calls, in the parser's format, whose arguments follow
the tool's JSON schema. Plain data here; the model process compiles it."""

from __future__ import annotations

import json
from typing import Any

from radixserve.chat.tool_parsers import ToolParser

GRAMMAR_KIND = "structural_tag"  # the kind SamplingParams.grammar carries it under


def tool_grammar(
    parser: ToolParser, tools: list[dict[str, Any]], parallel: bool
) -> tuple[str, str]:
    """The grammar forcing at least one call (exactly one unless ``parallel``) to one of
    ``tools``. ValueError where the parser's format cannot be constrained."""
    fmt = parser.constrained(tools, parallel)
    if fmt is None:
        raise ValueError(f"the {parser.name} tool-call format cannot be enforced by a grammar")
    return GRAMMAR_KIND, json.dumps({"type": "structural_tag", "format": fmt})
