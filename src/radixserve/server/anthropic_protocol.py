"""Anthropic's Messages API on the wire: request bodies (unknown fields refused), their
translation into the chat request the OpenAI route serves, and the message, usage, stop reason
and error shapes that go back. Pure: no engine, no I/O."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.chat import anthropic_errors
from radixserve.chat.anthropic import chat_messages, chat_tools
from radixserve.server.body_fields import (
    BootstrapHost,
    BootstrapPort,
    BootstrapRoom,
    TopK,
    unsupported,
)
from radixserve.server.errors import ApiError

_ALPHABET = string.ascii_letters + string.digits
NO_MEDIA = "this server serves text-only models"
REDACTED = "it holds reasoning Anthropic encrypted, which no model here can read"


class _Strict(BaseModel):
    # Anthropic's schema is closed: a field it does not define is refused (400 naming it)
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class CacheControl(_Strict):
    """Honoured by construction: the prefix cache keeps every prompt's KV, marked or not."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Any = unsupported("citations are not produced", None, ([],))


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Any = unsupported("programmatic tool calling is not implemented")
    toolset_name: Any = unsupported("toolsets are not implemented")


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False  # written into the result the model reads ("Error: ...")
    cache_control: CacheControl | None = None
    toolset_name: Any = unsupported("toolsets are not implemented")


class ThinkingBlock(_Strict):
    """A past turn's thinking: the template gets it as the turn's reasoning_content (and
    renders it or not, as the model was trained). The signature is not checked: this server
    signs nothing (its thinking blocks come back with an empty one). Redacted thinking is
    refused: what Anthropic encrypted no model here can read."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""
    signature: str = ""
    data: str = ""


class MediaBlock(_Strict):
    type: Literal["image", "document", "search_result"]
    source: Any = None
    cache_control: CacheControl | None = None


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | MediaBlock,
    Field(discriminator="type"),
]


class MessageParam(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")]


class ToolParam(_Strict):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search...) are not run
    cache_control: CacheControl | None = None
    strict: bool = False  # calls follow the schema (a grammar), as on the chat route
    eager_input_streaming: bool | None = None  # input fragments always stream as they come
    defer_loading: Any = unsupported("tool search is not implemented", False)
    allowed_callers: Any = unsupported("programmatic tool calling is not implemented", None,
                                       (["direct"],))  # fmt: skip
    input_examples: Any = unsupported("tool input examples are not shown to the model", None,
                                      ([],))  # fmt: skip


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(_Strict):
    user_id: str | None = None  # informational: who asked; nothing to apply


class JsonFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JsonFormat | None = None  # the output follows the schema (an xgrammar mask)
    effort: Any = unsupported("the served models have no effort setting")


class _Prompt(_Strict):
    """What renders the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Any = unsupported("thinking budgets are not implemented; with --reasoning-parser "
                                "the model's reasoning comes as thinking blocks",
                                None, ({"type": "disabled"},))  # fmt: skip
    mcp_servers: Any = unsupported("this server connects to no MCP servers", None, ([],))
    container: Any = unsupported("this server runs no code containers")
    context_management: Any = unsupported("the context is never edited by the server")
    cache_control: CacheControl | None = None  # automatic caching: what the server always does
    output_config: OutputConfig | None = None
    inference_geo: Any = unsupported("one server, one place")
    speed: Any = unsupported("one speed only", None, ("standard",))
    diagnostics: Any = unsupported("cache-miss diagnostics are not produced")
    # informational: whom the request is for; nothing to apply
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(_Prompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = -1
    metadata: Metadata | None = None
    service_tier: Any = unsupported("one tier only", None, ("auto", "standard_only"))
    # SGLang's prefill/decode fields, as on the OpenAI routes (a PD router fills them)
    bootstrap_host: BootstrapHost = None
    bootstrap_port: BootstrapPort = None
    bootstrap_room: BootstrapRoom = None


class CountTokensRequest(_Prompt):
    pass


BODIES = (MessagesRequest, CountTokensRequest)  # their schemas go into the OpenAPI document


# -- the request as a chat completion ----------------------------------------------------------
def chat_request(body: _Prompt) -> dict[str, Any]:
    """The OpenAI chat request (as JSON) that renders and samples ``body`` the same way: its
    prompt through radixserve.chat's translation, which the router renders with too."""
    _check_links(body.messages)
    _check_blocks(body)
    messages = [m.model_dump() for m in body.messages]
    out: dict[str, Any] = {"model": body.model, "messages": chat_messages(_system(body.system),
                                                                          messages)}  # fmt: skip
    if body.tools:
        out["tools"] = chat_tools([t.model_dump() for t in body.tools])
    if body.tool_choice is not None:
        out |= _tool_choice(body.tool_choice)
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": fmt.schema_}}  # fmt: skip
    if isinstance(body, MessagesRequest):
        out |= {"max_tokens": body.max_tokens, "stop": body.stop_sequences,
                "stream": body.stream, "temperature": body.temperature, "top_p": body.top_p,
                "top_k": body.top_k}  # fmt: skip
    return out


def _system(system: str | list[TextBlock] | None) -> str | None:
    return (
        system if system is None or isinstance(system, str) else "\n".join(b.text for b in system)
    )


ALLOWED = {"system": (TextBlock,), "user": (TextBlock, ToolResultBlock),
           "assistant": (TextBlock, ToolUseBlock, ThinkingBlock)}  # fmt: skip
"""The content blocks each role's message may hold."""


def _check_blocks(body: _Prompt) -> None:
    for m in body.messages:
        for b in m.content if isinstance(m.content, list) else []:
            if not isinstance(b, ALLOWED[m.role]) or b.type == "redacted_thinking":
                _refuse_block(b, m.role)


def _refuse_block(b: Any, role: str) -> None:
    why = (NO_MEDIA if isinstance(b, MediaBlock) else REDACTED if b.type == "redacted_thinking"
           else f"a {role} message cannot hold it")  # fmt: skip
    raise ApiError(400, f"content blocks of type {b.type!r} are not supported: {why}",
                   "unsupported_content", "messages")  # fmt: skip


def _check_links(messages: list[MessageParam]) -> None:
    """Each tool_result must answer a tool_use of an earlier assistant message."""
    seen: set[str] = set()
    for i, m in enumerate(messages):
        for j, b in enumerate(m.content if isinstance(m.content, list) else []):
            if isinstance(b, ToolUseBlock):
                seen.add(b.id)
            elif isinstance(b, ToolResultBlock) and b.tool_use_id not in seen:
                raise ApiError(400, f"tool_use_id {b.tool_use_id!r} names no tool_use block of "
                               "an earlier assistant message",
                               param=f"messages.{i}.content.{j}.tool_use_id")  # fmt: skip


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    if (choice.name is not None) != (choice.type == "tool"):
        raise ApiError(400, "tool_choice needs a name with type tool, and only then",
                       param="tool_choice.name")  # fmt: skip
    if choice.type == "tool":
        picked: Any = {"type": "function", "function": {"name": choice.name}}
    else:
        picked = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return {"tool_choice": picked, "parallel_tool_calls": not choice.disable_parallel_tool_use}


# -- the answer --------------------------------------------------------------------------------
def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_id(call_id: str) -> str:
    """A tool call's id in Anthropic's form (``toolu_`` and 24 letters and digits)."""
    tail = call_id.removeprefix("call_")
    return "toolu_" + (tail or "".join(secrets.choice(_ALPHABET) for _ in range(24)))


def stop_reason(finish: str | None, matched: Any, stops: list[str] | None) -> tuple[str, Any]:
    """Anthropic's stop_reason and stop_sequence for the chat route's finish reason."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stops or []):
        return "stop_sequence", matched
    return "end_turn", None


def usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    """Anthropic counts input apart from cache reads: input_tokens + cache_read_input_tokens
    is the whole prompt. Nothing is written on request (every prompt is cached anyway), so
    cache_creation_input_tokens is 0."""
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output}  # fmt: skip


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI chat message (content, reasoning_content, tool_calls) as Anthropic blocks."""
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for c in message.get("tool_calls") or []:
        fn = c["function"]
        args = call_input(fn["arguments"])
        out.append({"type": "tool_use", "id": tool_use_id(c["id"]), "name": fn["name"],
                    "input": args} if args is not None else {"type": "text",
                    "text": fn["arguments"]})  # fmt: skip
    return out


def call_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as tool_use input (an object), or None where they are not one."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def error_body(e: ApiError) -> dict[str, Any]:
    """Anthropic's error shape has no ``param``: the field at fault leads the message."""
    named = e.param is None or e.message.startswith(e.param)
    return anthropic_errors.error_body(e.status, e.message if named else f"{e.param}: {e.message}")
