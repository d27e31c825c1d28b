"""Constrained decoding of tool calls: for ``tool_choice`` "required" or a named function, an
xgrammar structural tag that admits only calls, in the parser's format, whose arguments follow
the tool's JSON schema; for "auto" with ``strict`` tools, free text in which each call that the
model opens is held to the schemas. Plain data here; the model process compiles it."""

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


def strict_auto_grammar(
    parser: ToolParser, tools: list[dict[str, Any]], parallel: bool
) -> tuple[str, str]:
    """Free text, but a call once opened (the format's opening text) follows the schemas: a
    tool without ``strict`` only by name. ValueError where the format has no opening tag."""
    loose = [t if t["function"].get("strict") else
             {**t, "function": {**t["function"], "parameters": {"type": "object"}}}
             for t in tools]  # fmt: skip
    fmt = parser.constrained(loose, parallel)
    tags = (fmt or {}).get("tags") or ([fmt] if fmt and fmt["type"] == "tag" else None)
    if not tags:
        raise ValueError(f"the {parser.name} tool-call format has no tag to hold calls to")
    auto = {"type": "triggered_tags", "triggers": [parser.start], "tags": tags,
            "at_least_one": False, "stop_after_first": not parallel}  # fmt: skip
    return GRAMMAR_KIND, json.dumps({"type": "structural_tag", "format": auto})
