"""Anthropic's Messages API with the official `anthropic` client against `radixserve serve` on
the built-in SmolLM2-135M (behind an API key, sent as x-api-key): a message whole and streamed,
stop sequences, the tool loop (a forced tool_use whose input follows the schema, a tool_result,
the answer), count_tokens against usage, prefix-cache reads in usage, errors in Anthropic's
shape, and every request field the SDK can send declared (honoured or refused by name)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from radixserve.server import anthropic_protocol as ap
from radixserve.server.body_fields import refused
from server_harness import ServerProcess

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-test-anthropic"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "The weather now in a city",
          "input_schema": WEATHER},
         {"name": "add", "description": "Add two integers", "input_schema": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK has no temperature argument


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(["--max-total-tokens", "8192", "--api-key", KEY])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def hello(client, server, **kw):
    return client.messages.create(model=server.name, max_tokens=24, system="Be brief.",
                                  messages=[{"role": "user", "content": "Say hello"}],
                                  **GREEDY, **kw)  # fmt: skip


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message(client, server):
    m = hello(client, server)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == server.name and m.content[0].type == "text" and text_of(m).strip()
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 24
    assert m.usage.input_tokens > 0 and m.usage.cache_creation_input_tokens == 0


def test_a_stop_sequence_ends_the_message_before_it(client, server):
    text = text_of(hello(client, server))
    word = text.split()[2]  # a word the greedy answer writes
    m = hello(client, server, stop_sequences=["zzz", word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert text_of(m) == text[: text.index(word)]


def test_streamed_with_the_sdk_helper_equals_the_whole_message(client, server):
    whole = hello(client, server)
    with client.messages.stream(model=server.name, max_tokens=24, system="Be brief.",
                                messages=[{"role": "user", "content": "Say hello"}],
                                **GREEDY) as stream:  # fmt: skip
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == text_of(whole) == text_of(final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24


def test_the_raw_events_come_in_anthropics_order(server):
    body = {"model": server.name, "max_tokens": 8, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello"}]}  # fmt: skip
    reply = server.post("/v1/messages", body, headers={"x-api-key": KEY,
                                                       "anthropic-version": "2023-06-01"})  # fmt: skip
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    blocks = [b.split("\n") for b in reply.body.decode().split("\n\n") if b.strip()]
    names = [b[0].removeprefix("event: ") for b in blocks]
    datas = [json.loads(b[1].removeprefix("data: ")) for b in blocks]
    assert all(d["type"] == n for n, d in zip(names, datas))
    deltas = names[3:-3]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(deltas) == {"content_block_delta"} and len(deltas) >= 1
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert datas[0]["message"]["usage"]["output_tokens"] == 0
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens"
    assert datas[-2]["usage"]["output_tokens"] == 8


def test_the_tool_loop_with_tool_choice_any(client, server):
    first = client.messages.create(model=server.name, max_tokens=48, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "any"}, **GREEDY)  # fmt: skip
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name in ("get_weather", "add")
    jsonschema.validate(
        call.input, next(t for t in TOOLS if t["name"] == call.name)["input_schema"]
    )
    result = {"city": "Paris", "temperature_c": 21, "sky": "sunny"}
    turns = [*ASK, {"role": "assistant", "content": first.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": json.dumps(result)}]}]  # fmt: skip
    final = client.messages.create(model=server.name, max_tokens=40, messages=turns,
                                   tools=TOOLS, **GREEDY)  # fmt: skip
    assert final.stop_reason == "end_turn" and [b.type for b in final.content] == ["text"]
    assert "sunny" in text_of(final) or "21" in text_of(final)  # the tool's result was read
    counted = client.messages.count_tokens(model=server.name, messages=turns, tools=TOOLS)
    u = final.usage
    # Anthropic counts cache reads apart: together they are the whole prompt
    assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens
    assert u.cache_read_input_tokens > 0  # the first turn's prompt was in the prefix cache


def test_a_named_tool_streamed(client, server):
    with client.messages.stream(model=server.name, max_tokens=48, tools=TOOLS,
                                messages=[{"role": "user", "content": "Weather in Rome?"}],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                **GREEDY) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "content_block_delta" in kinds and final.stop_reason == "tool_use"
    (call,) = final.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)


def test_output_config_format_is_followed(client, server):
    m = client.messages.create(model=server.name, max_tokens=40, messages=ASK, **GREEDY,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": WEATHER}})  # fmt: skip
    jsonschema.validate(json.loads(text_of(m)), WEATHER)


def test_the_readme_example_as_written(server):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("### Anthropic's Messages API") :]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = block.replace("http://127.0.0.1:30000", server.url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code.replace('api_key="unused"', f'api_key="{KEY}"'), {})
    shown = [line[2:] for line in block.splitlines() if line.startswith("# ")]
    call, stop, text = out.getvalue().split("\n", 2)
    assert call == "tool_use get_weather {'city': 'Paris'}"
    assert stop == "end_turn True"
    assert text.strip() == "\n".join(shown).removesuffix("   (135M parameters)")


def test_a_second_identical_request_reads_the_prefix_cache(client, server):
    ask = [{"role": "user", "content": "Name three rivers of Europe, with their lengths."}]
    first = client.messages.create(model=server.name, max_tokens=4, messages=ask, **GREEDY)
    again = client.messages.create(model=server.name, max_tokens=4, messages=ask, **GREEDY)
    counted = client.messages.count_tokens(model=server.name, messages=ask).input_tokens
    for m in (first, again):
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
    assert again.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens >= counted - 1  # all but the last token


def test_errors_come_in_anthropics_shape(client, server):
    ask = {"model": server.name, "max_tokens": 8, "messages": ASK}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**ask, extra_body={"bogus": 1})
    assert info.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "bogus: Extra inputs are not permitted"}}  # fmt: skip
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(**ask | {"model": "claude-nonesuch"})
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="^.*max_tokens: this request needs"):
        client.messages.create(**ask | {"max_tokens": 9000})  # past the 8,192-token pool
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.count_tokens(model=server.name, messages=ASK)
    assert info.value.body["error"]["type"] == "authentication_error"
    reply = server.post("/v1/messages", {"model": server.name, "messages": ASK},
                        headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert reply.status == 400 and reply.json()["error"]["message"].startswith("max_tokens")


def test_refused_fields_are_refused_by_name(server):
    for field in refused(ap.MessagesRequest):
        body = {"model": server.name, "max_tokens": 4, "messages": ASK, field: {"x": 1}}
        reply = server.post("/v1/messages", body, headers={"x-api-key": KEY})
        assert reply.status == 400, (field, reply.body)
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and f"{field} is not" in error["message"]


SDK_SHAPES = [
    ("message_create_params.MessageCreateParamsBase", ap.MessagesRequest),
    ("message_count_tokens_params.MessageCountTokensParams", ap.CountTokensRequest),
    ("tool_param.ToolParam", ap.ToolParam),
    ("text_block_param.TextBlockParam", ap.TextBlock),
    ("tool_use_block_param.ToolUseBlockParam", ap.ToolUseBlock),
    ("tool_result_block_param.ToolResultBlockParam", ap.ToolResultBlock),
    ("user_message_param.UserMessageParam", ap.MessageParam),
    ("system_message_param.SystemMessageParam", ap.MessageParam),
    ("metadata_param.MetadataParam", ap.Metadata),
]


@pytest.mark.parametrize(
    ("sdk", "model"), SDK_SHAPES, ids=[s.rsplit(".", 1)[1] for s, _ in SDK_SHAPES]
)
def test_every_field_the_sdk_can_send_is_declared(sdk, model):
    """A field the SDK sends but the server did not declare would be refused as unknown; one
    declared is honoured or refused by name (the tests above)."""
    module, name = sdk.rsplit(".", 1)
    shape = getattr(importlib.import_module(f"anthropic.types.{module}"), name)
    keys = set(shape.__required_keys__ | shape.__optional_keys__)
    assert keys - set(model.model_fields) - {"schema_"} == set()


SWITCH = ("{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
          "<think>\n\n</think>\n\n{% endif %}")  # fmt: skip


def test_thinking_disabled_reaches_a_template_with_the_switch(tiny_model_dir, tmp_path):
    """A template with an enable_thinking switch (as Qwen3's) gets enable_thinking false for
    `thinking: disabled`: the prompt gains the template's empty think block, counted and
    served."""
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "switch"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] += SWITCH
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tiny = ServerProcess(["--model", str(model), "--max-total-tokens", "2048"])
    try:
        body = {"model": tiny.name, "messages": ASK}
        off = body | {"thinking": {"type": "disabled"}}
        counts = [tiny.post("/v1/messages/count_tokens", b).json()["input_tokens"]
                  for b in (body, off)]  # fmt: skip
        assert counts[1] > counts[0]
        reply = tiny.post("/v1/messages", off | {"max_tokens": 2, "temperature": 0})
        assert reply.status == 200, reply.body
        usage = reply.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counts[1]
    finally:
        tiny.stop()


def test_thinking_disabled_is_served_where_there_is_no_reasoning(client, server):
    """No switch and no --reasoning-parser (SmolLM2): there is no reasoning to turn off."""
    m = hello(client, server, thinking={"type": "disabled"})
    assert m.stop_reason in ("end_turn", "max_tokens") and text_of(m)


# Qwen3's rule for past reasoning, in a few lines: an assistant turn's reasoning_content is
# rendered only after the last user query (a tool result is no query), i.e. in the tool loop
# under way; earlier turns' is dropped, as Anthropic drops its older models' earlier thinking.
QWEN3_LIKE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' and not "
    "m['content'].startswith('<tool_response>') %}{% set ns.last = loop.index0 %}{% endif %}"
    "{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == "
    "'assistant' and m.reasoning_content is defined and m.reasoning_content and loop.index0 > "
    "ns.last %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THOUGHT = {"type": "thinking", "thinking": "The user wants the weather: call the tool.",
           "signature": ""}  # fmt: skip
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                       "content": "sunny"}]}  # fmt: skip


def test_past_thinking_reaches_the_template_as_reasoning_content(tiny_model_dir, tmp_path):
    """A past turn's thinking is the template's to render: one following Qwen3's rule renders
    the thinking of the tool loop under way and drops an earlier turn's; the router renders
    the same prompt; the OpenAI route takes it as reasoning_content or reasoning."""
    from radixserve.router.proxy.kv_setup import load_tokenizer, prompt_ids
    from radixserve.router.proxy.request_body import routed_payload

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "qwen3-like"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": QWEN3_LIKE}))
    tiny = ServerProcess(["--model", str(model), "--max-total-tokens", "2048",
                          "--tool-call-parser", "hermes"])  # fmt: skip
    try:
        client = anthropic.Anthropic(base_url=tiny.url, api_key="-", max_retries=0)

        def count(*assistant: dict, after: list | None = None) -> int:
            turns = [ASK[0], {"role": "assistant", "content": list(assistant)}, *(after or [])]
            body = {"model": tiny.name, "messages": turns, "tools": TOOLS[:1]}
            n = client.messages.count_tokens(**body).input_tokens
            routed = prompt_ids(routed_payload(body, "/v1/messages"),
                                load_tokenizer(str(model)), tool_parser="hermes")  # fmt: skip
            assert routed is not None and len(routed) == n  # the router renders it alike
            return n

        assert count(THOUGHT, CALL, after=[RESULT]) > count(CALL, after=[RESULT])  # the loop
        later = [{"role": "user", "content": "And tomorrow?"}]
        answer = {"type": "text", "text": "Sunny."}
        assert count(THOUGHT, answer, after=later) == count(answer, after=later)  # an old turn
        said = {"role": "assistant", "content": "Sunny."}
        counts = [tiny.post("/tokenize", {"messages": [ASK[0], said | extra]}).json()["count"]
                  for extra in ({}, {"reasoning_content": "hmm"}, {"reasoning": "hmm"})]  # fmt: skip
        assert counts[1] == counts[2] > counts[0]  # the last turn: rendered, under either name
        bad = tiny.post("/tokenize", {"messages": [ASK[0] | {"reasoning": "hmm"}]})
        assert bad.status == 400 and bad.json()["error"]["param"] == "messages.0.reasoning"
    finally:
        tiny.stop()
