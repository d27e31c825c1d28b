"""Anthropic Messages bodies as the chat they render as: the system prompt, the messages' content
blocks and the tools turned into OpenAI chat messages and tools. One translation for the server
(which validates the body first) and the router (which renders it to route it). Pure: plain JSON
objects in and out. A past turn's thinking becomes its ``reasoning_content``, which the template
renders or drops as the model was trained (Qwen3's keeps the current tool loop's only)."""

from __future__ import annotations

import json
from typing import Any


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The OpenAI chat messages of a ``system`` prompt and Anthropic ``messages``: a user
    turn's tool results become tool messages ahead of its text, an assistant's tool uses its
    tool calls (input as JSON text)."""
    out = [] if system is None else [{"role": "system", "content": _text(system)}]
    for m in messages:
        content = m.get("content", "")
        if m.get("role") == "system":  # a system turn between others (text only)
            out.append({"role": "system", "content": _text(content)})
        elif m.get("role") == "user":
            out += _user(content)
        else:
            out.append(_assistant(content))
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The OpenAI function tools of Anthropic ``tools`` (None for none)."""
    return [_tool(t) for t in tools] if tools else None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") for b in content if b.get("type") == "text")


def _user(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, texts = [], []
    for b in content:
        if b.get("type") == "tool_result":
            result = ("Error: " if b.get("is_error") else "") + _text(b.get("content", ""))
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": result})
        elif b.get("type") == "text":
            texts.append(b.get("text", ""))
    return out + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant(content: Any) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls, thoughts = [], [], []
    for b in content:
        if b.get("type") == "text":
            texts.append(b.get("text", ""))
        elif b.get("type") == "tool_use":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"),
                                       "arguments": json.dumps(b.get("input"))}})  # fmt: skip
        elif b.get("type") == "thinking" and b.get("thinking"):
            thoughts.append(b["thinking"])
    out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    out |= {"reasoning_content": "\n".join(thoughts)} if thoughts else {}
    return out | {"tool_calls": calls} if calls else out


def _tool(t: dict[str, Any]) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.get("name"), "parameters": t.get("input_schema")}
    fn |= {"strict": True} if t.get("strict") else {}
    fn |= {"description": t["description"]} if t.get("description") else {}
    return {"type": "function", "function": fn}
