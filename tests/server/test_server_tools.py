"""Agents with the official `openai` client against `radixserve serve` on the built-in
SmolLM2-135M: the tool loop (a forced call, our function, a `tool` message, the answer) whole
and streamed, reasoning split off with --reasoning-parser qwen3, and tool fields refused."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from radixserve.server.chat_io import chat_output, forced_grammar, keeps_special_tokens
from radixserve.server.protocol import ChatCompletionRequest
from server_harness import ServerProcess

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
          "The weather now in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b":
          {"type": "integer"}}, "required": ["a", "b"]}}}]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 48}


def get_weather(city: str) -> dict:
    return {"city": city, "temperature_c": 21, "sky": "sunny"}


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(["--reasoning-parser", "qwen3", "--max-total-tokens", "8192"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def answer_with(call, result: dict) -> list[dict]:
    """The conversation after the model's call and our function's result."""
    done = {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}  # fmt: skip
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [done]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]  # fmt: skip


def test_the_tool_loop_with_a_named_function(client, server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=server.name, messages=ASK, tools=TOOLS,
                                           tool_choice=choice, **GREEDY)  # fmt: skip
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    result = get_weather(**args)
    final = client.chat.completions.create(model=server.name, messages=answer_with(call, result),
                                           tools=TOOLS, tool_choice="none", **GREEDY)  # fmt: skip
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "stop" and not message.tool_calls
    assert "sunny" in message.content or "21" in message.content  # the tool's result was read


def test_the_tool_loop_streamed_with_tool_choice_required(client, server):
    stream = client.chat.completions.create(model=server.name, messages=ASK, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            stream=True, **GREEDY)  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call: id, type and name
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": ""}
            calls[tc.index]["args"] += tc.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1  # parallel_tool_calls false: one call
    for c in calls.values():  # each call is one of the tools, its arguments valid for it
        tool = next(t["function"] for t in TOOLS if t["function"]["name"] == c["name"])
        jsonschema.validate(json.loads(c["args"]), tool["parameters"])
    c = calls[0]
    call = type("Call", (), {"id": c["id"], "function": type("F", (), {"name": c["name"],
                "arguments": c["args"]})})  # fmt: skip
    stream = client.chat.completions.create(model=server.name, tools=TOOLS, stream=True,
                                            messages=answer_with(call, {"result": "sunny"}),
                                            tool_choice="none", **GREEDY)  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text.strip()


def test_strict_tools_under_auto_are_held_to_their_schemas(client, server):
    """The grammar admits free text; a call, if this small model makes one, follows the schema
    (tests/chat/test_constrain.py shows on the same tokenizer that a bad call cannot pass)."""
    lyon = {"type": "object", "properties": {"city": {"enum": ["Lyon"]}}, "required": ["city"]}
    weather = {"name": "get_weather", "description": "Current weather in a city",
               "parameters": lyon, "strict": True}  # fmt: skip
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [
        {"type": "function", "function": weather}]})  # fmt: skip
    kind, spec = forced_grammar(body, "smollm2")
    assert kind == "structural_tag" and json.loads(spec)["format"]["type"] == "triggered_tags"
    reply = client.chat.completions.create(model=server.name, messages=ASK, max_tokens=60,
                                           tools=[{"type": "function", "function": weather}],
                                           temperature=0.0)  # fmt: skip
    for call in reply.choices[0].message.tool_calls or []:
        assert json.loads(call.function.arguments) == {"city": "Lyon"}  # not Paris: held


def test_reasoning_is_split_off_whole_and_streamed(client, server):
    # the regex makes even this small model think first (qwen3: reasoning opens with <think>)
    shape = {"regex": "<think>[a-z]{2,8}</think>[A-Z][a-z]{2,8}"}
    whole = client.chat.completions.create(model=server.name, messages=ASK, extra_body=shape,
                                           **GREEDY)  # fmt: skip
    msg = whole.choices[0].message.model_dump()
    assert msg["reasoning_content"] == msg["reasoning"] and msg["reasoning_content"].isalpha()
    assert msg["content"].isalpha() and msg["content"][0].isupper()
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(model=server.name, messages=ASK, stream=True,
                                                extra_body=shape, **GREEDY):  # fmt: skip
        delta = chunk.choices[0].delta.model_dump()
        for key in parts:
            parts[key] += delta.get(key) or ""
    assert parts == {"reasoning_content": msg["reasoning_content"], "content": msg["content"]}
    apart = client.chat.completions.create(model=server.name, messages=ASK, extra_body=shape |
                                           {"separate_reasoning": False}, **GREEDY)  # fmt: skip
    assert apart.choices[0].message.content.startswith("<think>")


def test_the_readme_tool_loop_runs_as_written(server):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("### Tools and reasoning") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code.replace("http://127.0.0.1:30000", server.url), {})
    name_args, final = out.getvalue().split("\n", 1)
    assert name_args == 'get_weather {"city": "Paris"}'
    assert final.startswith("stop ") and "sunny" in final  # the answer read the tool's result
    shown = [line[2:] for line in code.splitlines() if line.startswith("# ")]
    assert final.strip() == "\n".join(shown).removesuffix("   (135M parameters)")


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "add", "arguments": "not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
])  # fmt: skip
def test_bad_tool_fields_are_refused_naming_the_field(client, server, fields, param):
    body = {"messages": ASK, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.name, **{k: v for k, v in body.items()
                                       if k in ("messages", "tools", "tool_choice",
                                                "response_format")}, extra_body={
                                       k: v for k, v in body.items() if k not in
                                       ("messages", "tools", "tool_choice", "response_format")})  # fmt: skip
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("parser,fields,keeps", [
    ("mistral", {}, True),  # [TOOL_CALLS] is a special token: kept, or no call could be read
    ("mistral", {"skip_special_tokens": True}, False),  # the client's choice wins
    ("mistral", {"tool_choice": "none"}, False),  # no calls read: nothing to keep
    ("smollm2", {}, False),
])  # fmt: skip
def test_special_tokens_are_kept_where_a_format_opens_calls_with_one(parser, fields, keeps):
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, **fields})
    assert keeps_special_tokens(chat_output(parser, None, body), body) == keeps


def test_anthropic_thinking_disabled_is_refused_where_reasoning_cannot_be_turned_off(server):
    """SmolLM2's template has no enable_thinking switch: a server splitting reasoning off
    cannot honour `thinking: disabled`, so /v1/messages refuses it by name, in Anthropic's
    error shape (test_server_anthropic.py: a template with the switch gets it)."""
    body = {"model": server.name, "messages": ASK, "thinking": {"type": "disabled"}}
    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        reply = server.post(path, body | extra)
        assert reply.status == 400, reply.body
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith("thinking: "), error
