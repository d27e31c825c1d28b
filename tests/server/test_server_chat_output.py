"""A choice's text read with both a reasoning and a tool-call parser, as the server reads it:
whole, and streamed one character at a time, give the same message."""

from __future__ import annotations

import json

import pytest

from radixserve.chat.reasoning import get_reasoning_parser
from radixserve.chat.tool_parsers import get_tool_parser
from radixserve.server.chat_output import ChatOutput

TEXT = ('<think>The user wants weather.</think>\nChecking.\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')  # fmt: skip


def streamed(output: ChatOutput, text: str, reason: str) -> tuple[dict, str | None]:
    deltas = output.stream()
    found = [d for c in text for d in deltas.feed(c)]
    more, finish = deltas.finish(reason)
    message: dict = {"reasoning_content": "", "content": "", "calls": []}
    for d in found + more:
        message["reasoning_content"] += d.get("reasoning_content") or ""
        message["content"] += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                message["calls"].append([tc["function"]["name"], ""])
            message["calls"][tc["index"]][1] += tc["function"]["arguments"]
    return message, finish


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_reasoning_then_a_call_whole_and_streamed(reason):
    output = ChatOutput(get_tool_parser("hermes"), get_reasoning_parser("qwen3"))
    whole, finish = output.message(TEXT, reason)
    assert whole["reasoning_content"] == whole["reasoning"] == "The user wants weather."
    assert whole["content"] == "Checking."
    (call,) = whole["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert finish == ("tool_calls" if reason == "stop" else "length")
    got, streamed_finish = streamed(output, TEXT, reason)
    assert streamed_finish == finish
    assert got == {"reasoning_content": whole["reasoning_content"], "content": "Checking.",
                   "calls": [["get_weather", call["function"]["arguments"]]]}  # fmt: skip


def test_without_parsers_the_text_is_the_content():
    message, finish = ChatOutput().message(TEXT, "stop")
    assert message == {"role": "assistant", "content": TEXT} and finish == "stop"
    got, _ = streamed(ChatOutput(), TEXT, "stop")
    assert got == {"reasoning_content": "", "content": TEXT, "calls": []}
