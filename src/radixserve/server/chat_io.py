"""A chat request's tools and reasoning on the server: the checks of its tool fields, the
messages and template variables it renders with, the grammar that enforces a forced call, and
the parsers its choices are read with."""

from __future__ import annotations

import json
from typing import Any

from radixserve.chat.constrain import strict_auto_grammar, tool_grammar
from radixserve.chat.prompt import ChatError, template_inputs
from radixserve.chat.reasoning import get_reasoning_parser
from radixserve.chat.tool_parsers import get_tool_parser, parser_for_template
from radixserve.server.chat_output import ChatOutput
from radixserve.server.errors import ApiError
from radixserve.server.protocol import ChatCompletionRequest, NamedToolChoice


def tool_parser_name(configured: str, template: str | None) -> str | None:
    """The server's tool-call format: the flag's, or (auto) the one the template implies."""
    return parser_for_template(template) if configured == "auto" else configured


def chat_output(state_parser: str | None, reasoning: str | None, body: Any) -> ChatOutput:
    """The parsers one request's choices are read with."""
    parse_tools = body.tools and _choice(body) != "none"
    max_calls = None if body.parallel_tool_calls else 1
    tools = get_tool_parser(state_parser, max_calls) if parse_tools and state_parser else None
    think = get_reasoning_parser(reasoning) if reasoning and body.separate_reasoning else None
    return ChatOutput(tools, think)


def keeps_special_tokens(output: ChatOutput, body: ChatCompletionRequest) -> bool:
    """Whether the text must keep special tokens: the format opens its calls with one
    (``[TOOL_CALLS]``, ``<|python_tag|>``) and the client did not set skip_special_tokens."""
    special = output.tools is not None and output.tools.special_start
    return special and "skip_special_tokens" not in body.model_fields_set


def _choice(body: ChatCompletionRequest) -> str | NamedToolChoice:
    if body.tool_choice is None:
        return "auto" if body.tools else "none"
    return body.tool_choice


def check_tools(body: ChatCompletionRequest, parser: str | None) -> None:
    """Refuse (400 naming the field) tool settings the request cannot have."""
    choice = _choice(body)
    names = [t.function.name for t in body.tools or []]
    if body.tool_choice not in (None, "none") and not names:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not one of "
                       "the tools", param="tool_choice.function.name")  # fmt: skip
    if len(set(names)) != len(names):
        raise ApiError(400, "two tools have the same name", param="tools")
    if names and choice != "none" and parser is None:
        raise ApiError(400, "this model's chat template writes tool calls in a format the "
                       "server cannot tell: start it with --tool-call-parser", param="tools")  # fmt: skip


def forced_grammar(body: ChatCompletionRequest, parser: str | None) -> tuple[str, str] | None:
    """The grammar of tool_choice "required" or a named function, else None."""
    choice = _choice(body)
    if choice == "none" or parser is None:
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    if choice == "auto":
        return _strict_auto(body, tools, parser)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
    parallel = body.parallel_tool_calls and not isinstance(choice, NamedToolChoice)
    try:
        return tool_grammar(get_tool_parser(parser), tools, parallel)
    except ValueError as e:
        raise ApiError(400, f"tool_choice {json.dumps(_shown(choice))} cannot be enforced: {e}",
                       param="tool_choice") from None  # fmt: skip


def _strict_auto(
    body: ChatCompletionRequest, tools: list[dict[str, Any]], parser: str
) -> tuple[str, str] | None:
    """tool_choice auto with ``strict`` tools: the calls the model makes follow their schemas."""
    strict = [i for i, t in enumerate(tools) if t["function"].get("strict")]
    if not strict:
        return None
    try:
        return strict_auto_grammar(get_tool_parser(parser), tools, body.parallel_tool_calls)
    except ValueError as e:
        raise ApiError(400, f"strict tools cannot be enforced: {e}",
                       param=f"tools.{strict[0]}.function.strict") from None  # fmt: skip


def _shown(choice: str | NamedToolChoice) -> Any:
    return choice if isinstance(choice, str) else choice.model_dump()


def render_inputs(
    messages: list[dict[str, Any]], body: Any, template: str | None, parser: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables a chat renders with."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
    try:
        return template_inputs(messages, tools, template, get_tool_parser(parser) if parser
                               else None, body.chat_template_kwargs)  # fmt: skip
    except ChatError as e:
        raise ApiError(400, str(e), param=e.param) from None
