"""The tool-call formats by name (SGLang's and vLLM's names), and the one a chat template
implies where that is unambiguous."""

from __future__ import annotations

import re

from radixserve.chat.tool_parsers.base import ToolParser, ToolStream
from radixserve.chat.tool_parsers.hermes import HermesParser
from radixserve.chat.tool_parsers.llama3 import Llama3Parser
from radixserve.chat.tool_parsers.mistral import MistralParser
from radixserve.chat.tool_parsers.pythonic import PythonicParser
from radixserve.chat.tool_parsers.smollm2 import SmolLM2Parser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,  # SGLang's name for the same format
    "llama3": Llama3Parser,
    "pythonic": PythonicParser,
    "mistral": MistralParser,
    "smollm2": SmolLM2Parser,
}
# what a template writes for past calls -> the format its model answers in
_TEMPLATE_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3"),
                     ("<tool_call>", "hermes"))  # fmt: skip
AUTO = "auto"


def get_tool_parser(name: str, max_calls: int | None = None) -> ToolParser:
    """The parser registered as ``name``; KeyError naming the known ones."""
    if name not in TOOL_PARSERS:
        raise KeyError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](max_calls)


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself (else the default form is used)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def parser_for_template(template: str | None) -> str | None:
    """The format a template implies: its tool-call markers; the default form's (smollm2) for a
    template that knows no tools; None where the template knows tools in a form not known."""
    if not knows_tools(template):
        return "smollm2"
    found = [name for marker, name in _TEMPLATE_MARKERS if marker in (template or "")]
    return found[0] if len(found) == 1 else None


__all__ = ["TOOL_PARSERS", "ToolParser", "ToolStream", "get_tool_parser", "parser_for_template"]
