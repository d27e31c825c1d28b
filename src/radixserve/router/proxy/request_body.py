"""What the router reads of an inference request body: its prompt (one rule for every policy:
the tree's key and kv_aware's token ids come from the same extraction) and the namespace the
engine caches it under. Pure: a parsed JSON object in, plain data out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.chat.anthropic import chat_messages, chat_tools
from radixserve.router.policies.base import RequestView

PART_SEPARATOR = "\n"
"""How a message's text content parts join into one string before the chat template renders
it: vLLM's rule (chat_utils joins the text parts with a newline), which radixserve's server
follows too, so the router sees the prompt the workers template."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the worker will read it: token ids, chat messages (each
    {"role", "content"[, "name"]}, text parts joined), or text; all None when the body has no
    prompt the router can read (the worker answers with the error)."""

    ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    add_generation_prompt: bool = True  # chat only: the assistant's turn opened after them
    continue_final_message: bool = False  # chat only: the last message left open instead
    tools: list[dict[str, Any]] | None = None  # chat only: rendered into the prompt
    template_kwargs: dict[str, Any] | None = None  # chat only: chat_template_kwargs


def extract_prompt(payload: dict[str, Any]) -> Prompt:
    """The prompt of a /generate, /v1/completions or /v1/chat/completions body: `input_ids`,
    else `messages` (with `add_generation_prompt`, default true, and `continue_final_message`,
    default false, as vLLM reads them), else `text`, else `prompt`; a batch routes on its
    first prompt, and a prompt that is a list of ints is token ids (OpenAI's prompt may be)."""
    ids = payload.get("input_ids")
    if _is_ids(ids):
        return Prompt(ids=ids)
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        if not all(isinstance(m, dict) for m in messages):
            return Prompt()
        opened = payload.get("add_generation_prompt", True)
        continued = payload.get("continue_final_message", False)
        if type(opened) is not bool or type(continued) is not bool or (opened and continued):
            return Prompt()  # the worker refuses it (vLLM: both true is an error)
        tools, kwargs = payload.get("tools"), payload.get("chat_template_kwargs")
        if not _is_dicts(tools) or (kwargs is not None and not isinstance(kwargs, dict)):
            return Prompt()  # the worker refuses it
        return Prompt(
            messages=[chat_message(m) for m in messages],
            add_generation_prompt=opened,
            continue_final_message=continued,
            tools=[chat_tool(t) for t in tools] if tools else None,
            template_kwargs=kwargs,
        )
    text = payload.get("text", payload.get("prompt"))
    if isinstance(text, list) and text and not _is_ids(text):
        text = text[0]  # a batch routes on its first prompt
    if _is_ids(text):
        return Prompt(ids=text)
    return Prompt(text=text) if isinstance(text, str) else Prompt()


REASONING = ("reasoning_content", "reasoning")
"""A past assistant turn's reasoning, under either name (the server takes the first given)."""


def chat_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the server normalises it before templating: text parts joined with
    PART_SEPARATOR, missing content as "", past tool calls with their defaults filled in, past
    reasoning as reasoning_content (the template sees the same dicts, keys in the same order)."""
    content = m.get("content")
    if isinstance(content, list):
        content = PART_SEPARATOR.join(
            str(p.get("text") or "") for p in content if isinstance(p, dict)
        )
    out: dict[str, Any] = {"role": m.get("role"), "content": content or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [_call(c) for c in m["tool_calls"]]
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = m["tool_call_id"]
    reasoning = next((m[k] for k in REASONING if m.get(k) is not None), None)
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out | {"name": m["name"]} if m.get("name") else out


def _call(c: dict[str, Any]) -> dict[str, Any]:
    fn = c.get("function") or {}
    return {"id": c.get("id"), "type": c.get("type", "function"),
            "function": {"name": fn.get("name"), "arguments": fn.get("arguments", "{}")}}  # fmt: skip


def chat_tool(t: dict[str, Any]) -> dict[str, Any]:
    """A tool as the server hands it to the template: its fields in their declared order,
    unset ones left out (the template may print the tool as JSON)."""
    fn = t.get("function") or {}
    kept = {
        k: fn[k] for k in ("name", "description", "parameters", "strict") if fn.get(k) is not None
    }
    return {"type": t.get("type"), "function": kept}


def routed_payload(payload: Any, path: str) -> Any:
    """The body the router reads the prompt of: an Anthropic /v1/messages (or count_tokens) body
    as the OpenAI chat the server renders it as (radixserve.chat's translation), else as sent."""
    if not path.startswith("/v1/messages") or not isinstance(payload, dict):
        return payload
    messages, tools = payload.get("messages"), payload.get("tools")
    if not _is_dicts(messages) or not _is_dicts(tools):
        return {"model": payload.get("model")}  # the worker refuses it
    try:
        out = {"model": payload.get("model"),
               "messages": chat_messages(payload.get("system"), messages or [])}  # fmt: skip
        return out | {"tools": chat_tools(tools)} if tools else out
    except (AttributeError, TypeError):  # an odd block: the worker says what is wrong
        return {"model": payload.get("model")}


def request_view(payload: dict[str, Any]) -> RequestView:
    """The routing view of a request body: its token ids if it gives them, else its text or
    its messages rendered as "<role>content" lines, in the namespace (model, LoRA adapter,
    cache salt) the engine caches under."""
    prompt = extract_prompt(payload)
    text = prompt.text
    if prompt.messages is not None:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in prompt.messages)
    lora = payload.get("lora_path", payload.get("lora")) or ""
    return RequestView.from_prompt(
        text if prompt.ids is None else None,
        prompt.ids,
        str(payload.get("model") or ""),
        lora if isinstance(lora, str) else str(lora),
        str(payload.get("cache_salt") or ""),
    )


def _is_dicts(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(v, dict) for v in value))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)
