"""A streamed Anthropic message as its server-sent events, in Anthropic's order: message_start,
then per content block content_block_start, its deltas and content_block_stop (a ping after the
first start), then message_delta (stop reason, usage) and message_stop. Fed the OpenAI chat
deltas the chat route's parsers produce; pure: no I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.anthropic_protocol import tool_use_id

Event = tuple[str, dict[str, Any]]  # (event name, data)


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    return (
        f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
    )


@dataclass
class MessageEvents:
    """The events of one message. ``kind`` is the open block's type (None: no block open);
    ``calls`` maps a tool call's OpenAI index to its block's index."""

    blocks: int = 0
    kind: str | None = None
    pinged: bool = False
    calls: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def start(head: dict[str, Any], usage: dict[str, Any]) -> list[Event]:
        """message_start: the message with no content yet; output_tokens 0 so far."""
        message = head | {"content": [], "stop_reason": None, "stop_sequence": None,
                          "usage": usage | {"output_tokens": 0}}  # fmt: skip
        return [("message_start", {"type": "message_start", "message": message})]

    def feed(self, deltas: list[dict[str, Any]]) -> list[Event]:
        """The events of OpenAI chat deltas (reasoning_content, content, tool_calls)."""
        out: list[Event] = []
        for d in deltas:
            if d.get("reasoning_content"):
                out += self._into("thinking", {"thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta",
                                        "thinking": d["reasoning_content"]}))  # fmt: skip
            if d.get("content"):
                out += self._into("text", {"text": ""})
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
            for call in d.get("tool_calls") or []:
                out += self._call(call)
        return out

    def finish(
        self, stop_reason: str, stop_sequence: str | None, output_tokens: int
    ) -> list[Event]:
        """Close the open block; the message's stop reason and output tokens; message_stop."""
        out = self._close() + ([] if self.pinged else [("ping", {"type": "ping"})])
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        out.append(("message_delta", {"type": "message_delta", "delta": delta,
                                      "usage": {"output_tokens": output_tokens}}))  # fmt: skip
        return out + [("message_stop", {"type": "message_stop"})]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        fn = call.get("function") or {}
        if call.get("id"):  # a call's first delta: a new tool_use block
            out += self._open("tool_use", {"id": tool_use_id(call["id"]), "name": fn.get("name"),
                                           "input": {}})  # fmt: skip
            self.calls[call["index"]] = self.blocks - 1
        if fn.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
            out.append(self._delta(delta, self.calls[call["index"]]))
        return out

    def _into(self, kind: str, empty: dict[str, Any]) -> list[Event]:
        """Open a block of ``kind`` unless one is open already."""
        return [] if self.kind == kind else self._open(kind, empty)

    def _open(self, kind: str, empty: dict[str, Any]) -> list[Event]:
        out = self._close()
        block = {"type": kind} | empty
        out.append(("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                             "content_block": block}))  # fmt: skip
        if not self.pinged:
            out.append(("ping", {"type": "ping"}))
            self.pinged = True
        self.kind, self.blocks = kind, self.blocks + 1
        return out

    def _close(self) -> list[Event]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> Event:
        at = self.blocks - 1 if index is None else index
        return ("content_block_delta", {"type": "content_block_delta", "index": at,
                                        "delta": delta})  # fmt: skip
