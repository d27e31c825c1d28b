"""Messages and tools as the chat template gets them. A template that renders ``tools`` gets
them as transformers passes them (the OpenAI tool objects, past calls' arguments as objects);
one that knows no tools gets the default form: a system-prompt section listing the tools' JSON
schemas and the call format of the parser in use, past calls written in that format, and tool
results as user turns inside ``<tool_response>`` tags."""

from __future__ import annotations

import json
import re
from typing import Any

from radixserve.chat.tool_parsers import ToolParser, knows_tools

RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
EXAMPLE = [{"name": "function_name", "arguments": {"argument_name": "value"}}]


class ChatError(ValueError):
    """A request the chat layer cannot render; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def template_inputs(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str | None,
    parser: ToolParser | None, kwargs: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """The messages and the extra template variables (``tools``, ``chat_template_kwargs``)."""
    _check_links(messages)
    messages = [_with_reasoning(m) for m in messages]
    extra = _checked_kwargs(kwargs or {}, template)
    if knows_tools(template):
        return [_for_template(m, i) for i, m in enumerate(messages)], extra | (
            {"tools": tools} if tools else {}
        )
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, extra
    if parser is None:
        raise ChatError("no tool-call parser for this model: start the server with "
                        "--tool-call-parser", "tools")  # fmt: skip
    return default_form(messages, tools or [], parser), extra


def transformers_inputs(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """What vLLM and SGLang hand the template (transformers' apply_chat_template): the messages
    with past calls' arguments as objects and past reasoning under both names (as vLLM does),
    ``tools`` and the kwargs as variables, whether or not the template renders them (a template
    that knows no tools drops them)."""
    extra = dict(kwargs or {}) | ({"tools": tools} if tools else {})
    return [_for_template(_with_reasoning(m), i) for i, m in enumerate(messages)], extra


def _check_links(messages: list[dict[str, Any]]) -> None:
    """A tool message's ``tool_call_id`` must name a call of an earlier assistant message."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        ids.update(c.get("id") for c in m.get("tool_calls") or [] if c.get("id"))
        link = m.get("tool_call_id")
        if link is not None and (m["role"] != "tool" or link not in ids):
            raise ChatError("tool_call_id must be on a tool message and name an earlier "
                            "assistant message's tool call", f"messages.{i}.tool_call_id")  # fmt: skip


def _with_reasoning(m: dict[str, Any]) -> dict[str, Any]:
    """A past turn's reasoning under both its names: Qwen3's and DeepSeek's templates read
    ``reasoning_content``, newer ones ``reasoning`` (vLLM's name)."""
    given = m.get("reasoning_content") or m.get("reasoning")
    return m | {"reasoning_content": given, "reasoning": given} if given else m


def _checked_kwargs(kwargs: dict[str, Any], template: str | None) -> dict[str, Any]:
    for key in kwargs:
        if key in RESERVED:
            raise ChatError(f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
        if not re.search(rf"\b{re.escape(key)}\b", template or ""):
            raise ChatError(f"this model's chat template does not use {key!r}",
                            "chat_template_kwargs")  # fmt: skip
    return dict(kwargs)


def _for_template(m: dict[str, Any], i: int) -> dict[str, Any]:
    """transformers' form of a message: past calls' arguments as objects, not JSON text."""
    if not m.get("tool_calls"):
        return m
    calls = [c | {"function": c["function"] | {"arguments": call_arguments(c, i, j)}}
             for j, c in enumerate(m["tool_calls"])]  # fmt: skip
    return m | {"tool_calls": calls}


def call_arguments(call: dict[str, Any], i: int, j: int) -> dict[str, Any]:
    """A past call's arguments (JSON text) as an object; ChatError naming it if they are not."""
    raw = call["function"].get("arguments") or "{}"
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ChatError("a tool call's arguments must be a JSON object",
                        f"messages.{i}.tool_calls.{j}.function.arguments")  # fmt: skip
    return value


def default_form(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], parser: ToolParser
) -> list[dict[str, Any]]:
    """The messages for a template that knows no tools (see the module's docstring)."""
    out = [_plain(m, i, parser) for i, m in enumerate(messages)]
    if not tools:
        return out
    section = tools_section(tools, parser)
    if out and out[0]["role"] == "system":
        return [out[0] | {"content": f"{out[0]['content']}\n\n{section}"}, *out[1:]]
    return [{"role": "system", "content": section}, *out]


def tools_section(tools: list[dict[str, Any]], parser: ToolParser) -> str:
    """The system prompt's section that lists the tools and how to call them."""
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You may call functions to answer. Each is described by a JSON schema:\n"
        f"<tools>\n{schemas}\n</tools>\n"
        "To call functions, answer with the calls only, written exactly like this:\n"
        f"{parser.render(EXAMPLE)}\n"
        "If no function fits, answer in plain text."
    )


def _plain(m: dict[str, Any], i: int, parser: ToolParser) -> dict[str, Any]:
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    if not m.get("tool_calls"):
        return m
    calls = [{"name": c["function"]["name"], "arguments": call_arguments(c, i, j)}
             for j, c in enumerate(m["tool_calls"])]  # fmt: skip
    text = parser.render(calls)
    content = f"{m['content']}\n{text}" if m.get("content") else text
    return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": content}
