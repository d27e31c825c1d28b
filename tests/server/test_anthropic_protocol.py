"""Anthropic's Messages API without a server: requests translated into the chat request the
OpenAI route serves (system, text, tool_use / tool_result blocks, tool_choice), fields refused by
name, and the streamed events in Anthropic's order adding up to the whole message."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from radixserve.chat.reasoning import get_reasoning_parser
from radixserve.chat.tool_parsers import get_tool_parser
from radixserve.server.anthropic_events import MessageEvents
from radixserve.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    content_blocks,
    error_body,
    stop_reason,
    usage,
)
from radixserve.server.body_fields import check_supported
from radixserve.server.chat_output import ChatOutput
from radixserve.server.errors import ApiError
from radixserve.server.protocol import ChatCompletionRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "text", "text": "sunny"}]},
        {"type": "text", "text": "And tomorrow?"},
    ]},
    {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
]  # fmt: skip


def request(**fields) -> MessagesRequest:
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **fields})
    check_supported(body)
    return body


def test_a_tool_loop_becomes_the_chat_the_openai_route_renders():
    body = request(system=[{"type": "text", "text": "Be brief."}], messages=LOOP, tools=[TOOL],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                   stop_sequences=["\n\n"], temperature=0.5, top_k=4)  # fmt: skip
    chat = chat_request(body)
    ChatCompletionRequest.model_validate(chat)  # what the route validates it as
    call = {"id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "system", "content": "Answer in French."},
    ]
    fn = {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}
    assert chat["tools"] == [{"type": "function", "function": fn}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert (chat["stop"], chat["temperature"], chat["top_k"], chat["max_tokens"]) == (
        ["\n\n"], 0.5, 4, 8)  # fmt: skip


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}}),
])  # fmt: skip
def test_tool_choice(choice, expected):
    chat = chat_request(request(messages=LOOP[:1], tools=[TOOL], tool_choice=choice))
    assert chat["tool_choice"] == expected and chat["parallel_tool_calls"] is True


def test_an_error_tool_result_says_so_and_past_thinking_is_the_turns_reasoning():
    loop = [LOOP[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "s"}, LOOP[1]["content"][1],
        {"type": "thinking", "thinking": "and so", "signature": "t"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "no such city", "is_error": True}]}]  # fmt: skip
    chat = chat_request(request(messages=loop))
    ChatCompletionRequest.model_validate(chat)  # what the route validates it as
    messages = chat["messages"]
    assert messages[1]["content"] is None and messages[1]["reasoning_content"] == "hmm\nand so"
    assert messages[2] == {"role": "tool", "tool_call_id": "toolu_1",
                           "content": "Error: no such city"}  # fmt: skip


def test_redacted_thinking_is_refused_by_name():
    loop = [LOOP[0], {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "EuYBCkQYAiJA"}, {"type": "text", "text": "Hi"}]},
        {"role": "user", "content": "Go on"}]  # fmt: skip
    with pytest.raises(ApiError) as e:
        chat_request(request(messages=loop))
    assert (
        e.value.status == 400
        and "redacted_thinking" in str(e.value)
        and "encrypted" in str(e.value)
    )


def test_count_tokens_renders_the_same_prompt():
    fields = {"model": "m", "messages": LOOP, "tools": [TOOL], "system": "Be brief."}
    counted = chat_request(CountTokensRequest.model_validate(fields))
    sent = chat_request(request(**{k: v for k, v in fields.items() if k != "model"}))
    assert counted["messages"] == sent["messages"] and counted["tools"] == sent["tools"]


@pytest.mark.parametrize("fields,named", [
    ({"bogus": 1}, "bogus"),
    ({"messages": [{"role": "user", "content": "x", "name": "me"}]}, "messages.0.name"),
    ({"tools": [TOOL | {"defer_loading": True}]}, "tools.0.defer_loading"),
    ({"tools": [TOOL | {"input_schema": "{}"}]}, "tools.0.input_schema"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"speed": "fast"}, "speed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
])  # fmt: skip
def test_fields_it_cannot_honour_are_refused_by_name(fields, named):
    with pytest.raises((ValidationError, ApiError)) as info:
        request(**{"messages": LOOP[:1], **fields})
    e = info.value
    e = ApiError.from_validation(e) if isinstance(e, ValidationError) else e
    assert e.status == 400 and named in e.message


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}],
     "messages.0.content.0.tool_use_id"),
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages"),
])  # fmt: skip
def test_unanswerable_blocks_are_refused(messages, param):
    with pytest.raises(ApiError) as info:
        chat_request(request(messages=messages))
    assert info.value.status == 400 and info.value.param == param


def test_tool_choice_tool_needs_a_name():
    with pytest.raises(ApiError, match="tool_choice needs a name"):
        chat_request(request(messages=LOOP[:1], tools=[TOOL], tool_choice={"type": "tool"}))


def test_stop_reasons_and_usage():
    assert stop_reason("tool_calls", None, None) == ("tool_use", None)
    assert stop_reason("length", None, None) == ("max_tokens", None)
    assert stop_reason("stop", "END", ["END"]) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, ["END"]) == ("end_turn", None)  # the EOS token
    assert usage(100, 64, 5) == {"input_tokens": 36, "cache_creation_input_tokens": 0,
                                 "cache_read_input_tokens": 64, "output_tokens": 5}  # fmt: skip
    e = error_body(ApiError(404, "no such model", param="model"))
    assert e == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model: no such model"},
    }


TEXT = 'Sure.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'


def replay(events: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks a client builds from the events, checking Anthropic's order."""
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("ping") == 1 and names[names.index("ping") - 1] == "content_block_start"
    blocks, open_ = [], None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_ is None and data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
            open_ = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_
            d, b = data["delta"], blocks[open_]
            key = {"text_delta": "text", "input_json_delta": "partial_json",
                   "thinking_delta": "thinking"}[d["type"]]  # fmt: skip
            b["json" if key == "partial_json" else key] = b.get(
                "json" if key == "partial_json" else key, "") + d[key]  # fmt: skip
        elif name == "content_block_stop":
            assert data["index"] == open_
            open_ = None
    assert open_ is None
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("json"))
            b.pop("id")
    return blocks


@pytest.mark.parametrize("step", [1, 3, len(TEXT)])
def test_streamed_events_add_up_to_the_whole_message(step):
    text = "<think>Paris is a city.</think>" + TEXT
    output = ChatOutput(get_tool_parser("smollm2"), get_reasoning_parser("qwen3"))
    seq, deltas = MessageEvents(), output.stream()
    events = MessageEvents.start({"id": "msg_1"}, {"input_tokens": 3})
    for i in range(0, len(text), step):
        events += seq.feed(deltas.feed(text[i : i + step]))
    more, finish = deltas.finish("stop")
    events += seq.feed(more) + seq.finish(*stop_reason(finish, None, None), 12)
    whole, whole_finish = output.message(text, "stop")
    expected = content_blocks(whole)
    for b in expected:
        b.pop("id", None)
    assert replay(events) == expected
    assert [b["type"] for b in expected] == ["thinking", "text", "tool_use"]
    assert (
        events[-2][1]["delta"]["stop_reason"] == "tool_use" == stop_reason(whole_finish, 0, [])[0]
    )
    assert events[-2][1]["usage"] == {"output_tokens": 12}


def test_a_message_without_content_still_pings_and_stops():
    seq = MessageEvents()
    events = MessageEvents.start({"id": "msg_1"}, {"input_tokens": 3}) + seq.finish(
        "end_turn", None, 0
    )
    assert [n for n, _ in events] == ["message_start", "ping", "message_delta", "message_stop"]
