"""The rule, table-driven: every field of the request models (OpenAI's completions and chat
completions, SGLang's /generate and its sampling_params, a chat message) is either honoured,
with a check here that fails if the server ignored it, or refused with a 400 naming it.

The fields are read from the models themselves, so a field added later fails this test until
it is refused (declared with ``body_fields.unsupported``) or given a check in HONOURED. To honour
a refused field: give it a real type in server/protocol.py, use it, and add its check here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from field_checks_sampling import make_checks
from radixserve.server import body_fields, protocol
from server_harness import assert_error_body

PROMPT = "the quick brown fox jumps over the lazy dog and"
CHAT = [{"role": "user", "content": "a radix tree"}]
REFUSED_SAMPLE = {"a value": "no default of any field equals"}


@dataclass(frozen=True)
class Route:
    """Where a model's fields go in a request: the endpoint, a base body, the nesting."""

    path: str
    base: dict[str, Any]
    nest: str = ""  # "sampling_params" or "messages": the field sits in that object

    def body(self, **fields: Any) -> dict[str, Any]:
        body = json.loads(json.dumps(self.base))
        if self.nest == "messages":
            body["messages"][0].update(fields)
        elif self.nest:
            body[self.nest].update(fields)
        else:
            body.update(fields)
        return body

    def param(self, field: str) -> str:
        return {"messages": "messages.0.", "sampling_params": "sampling_params."}.get(
            self.nest, ""
        ) + field

    @property
    def openai(self) -> bool:
        return self.path.startswith("/v1/")


ROUTES = {
    protocol.CompletionRequest: Route("/v1/completions", {"prompt": PROMPT, "max_tokens": 8}),
    protocol.ChatCompletionRequest: Route(
        "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8}
    ),  # fmt: skip
    protocol.ChatMessage: Route(
        "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8}, "messages"
    ),  # fmt: skip
    protocol.GenerateRequest: Route(
        "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 8}}
    ),  # fmt: skip
    protocol.GenerateSampling: Route(
        "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 8}}, "sampling_params"
    ),  # fmt: skip
}


@dataclass
class Out:
    """One answer, the same shape whatever the route."""

    texts: list[str]
    finish: list[str]
    completion_tokens: int
    prompt_tokens: int
    raw: Any


def send(server, route: Route, **fields: Any) -> Out:
    reply = server.post(route.path, route.body(**fields))
    assert reply.status == 200, reply.body
    data = reply.json()
    if route.openai:
        choices = data["choices"]
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
        usage = data["usage"]
        return Out(texts, [c["finish_reason"] for c in choices], usage["completion_tokens"],
                   usage["prompt_tokens"], data)  # fmt: skip
    meta = data["meta_info"]
    return Out([data["text"]], [meta["finish_reason"]["type"]], meta["completion_tokens"],
               meta["prompt_tokens"], data)  # fmt: skip


def sampled(server, route: Route, **fields: Any) -> str:
    """A sampled (temperature 1) text; ``fields`` go where the route's sampling fields go."""
    fields = {"temperature": 1.0, "ignore_eos": True, **fields}
    if route.openai or route.nest == "sampling_params":
        return send(server, route, **fields).texts[0]
    return send(server, ROUTES[protocol.GenerateSampling], **fields).texts[0]


def greedy_ids(server, route: Route) -> list[int]:
    """The greedy output ids of the route's base prompt (via /generate on the same ids)."""
    if route.path == "/v1/chat/completions":
        ids = server.post("/tokenize", {"messages": CHAT}).json()["tokens"]
    else:
        ids = server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
            "ignore_eos": True}}  # fmt: skip
    return server.post("/generate", body).json()["output_ids"]


# -- the checks: each fails if the server ignored the field ------------------------------------
Check = Callable[[Any, Route], None]


def check_temperature(server, route: Route) -> None:
    assert sampled(server, route, temperature=0, seed=1) == sampled(server, route, temperature=0,
                                                                    seed=2)  # fmt: skip
    assert sampled(server, route, seed=1) != sampled(server, route, seed=2)


def check_seed(server, route: Route, name: str = "seed") -> None:
    assert sampled(server, route, **{name: 5}) == sampled(server, route, **{name: 5})
    assert sampled(server, route, **{name: 5}) != sampled(server, route, **{name: 6})


def check_top_p(server, route: Route) -> None:  # only the most likely token is left
    greedy = sampled(server, route, temperature=0)
    assert sampled(server, route, top_p=1e-9, seed=3) == greedy != sampled(server, route, seed=3)


def check_top_k(server, route: Route) -> None:
    greedy = sampled(server, route, temperature=0)
    assert sampled(server, route, top_k=1, seed=3) == greedy != sampled(server, route, seed=3)


def check_stop(server, route: Route) -> None:
    text = sampled(server, route, temperature=0)
    half = text[len(text) // 2 :]
    plain = [half[i : i + 2] for i in range(len(half) - 1) if half[i : i + 2].isalnum()]
    stop = (plain or [half[:2]])[0]
    out = send(server, route, temperature=0, ignore_eos=True, stop=[stop])
    assert out.texts[0] == text[: text.index(stop)] and out.finish[0] == "stop"


def check_stop_token_ids(server, route: Route) -> None:
    ids = greedy_ids(server, route)
    out = send(server, route, temperature=0, ignore_eos=True, stop_token_ids=[ids[3]])
    assert out.completion_tokens == ids.index(ids[3]) + 1 and out.finish[0] == "stop"


def check_ignore_eos(server, route: Route) -> None:
    # find a seed whose sample reaches the model's EOS early; the same seed with ignore_eos
    # runs on past it to the limit
    for seed in range(60):
        kw = {"temperature": 1.5, "seed": seed, **_limit(route, 80)}
        first = send(server, route, ignore_eos=False, **kw)
        if first.finish[0] == "stop":
            on = send(server, route, ignore_eos=True, **kw)
            assert on.completion_tokens == 80 > first.completion_tokens
            assert on.finish[0] == "length" and on.texts[0].startswith(first.texts[0])
            return
    raise AssertionError("no sample reached EOS: cannot tell whether ignore_eos is honoured")


def _limit(route: Route, n: int) -> dict[str, int]:
    return {"max_tokens": n} if route.openai else {"max_new_tokens": n}


def check_limit(name: str) -> Check:
    def check(server, route: Route) -> None:
        out = send(server, route, **{name: 3, "ignore_eos": True})
        assert out.completion_tokens == 3 and out.finish == ["length"]

    return check


def check_n(server, route: Route) -> None:
    assert len(send(server, route, n=3).texts) == 3


def check_stream(server, route: Route) -> None:
    reply = server.post(route.path, route.body(stream=True))
    events = reply.events()
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]" and len(events) > 2


def check_stream_options(server, route: Route) -> None:
    body = route.body(stream=True, stream_options={"include_usage": True}, ignore_eos=True)
    chunks = [json.loads(e) for e in server.post(route.path, body).events()[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def check_model(server, route: Route) -> None:
    assert send(server, route, model=server.name).texts
    assert assert_error_body(server.post(route.path, route.body(model="nope")), 404)[
        "param"] == "model"  # fmt: skip


def check_prompt(server, route: Route) -> None:
    count = server.post("/tokenize", {"prompt": PROMPT}).json()["count"]
    assert send(server, route).prompt_tokens == count
    assert send(server, route, prompt="other words").prompt_tokens != count


def check_text_or_ids(server, route: Route) -> None:
    ids = server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    by_ids = server.post("/generate", {"input_ids": ids, "sampling_params": {"temperature": 0,
                         "max_new_tokens": 8}}).json()  # fmt: skip
    by_text = send(server, route, text=PROMPT, sampling_params={"temperature": 0,
                   "max_new_tokens": 8})  # fmt: skip
    assert by_text.raw["text"] == by_ids["text"] and by_text.prompt_tokens == len(ids)


def check_messages(server, route: Route) -> None:
    count = server.post("/tokenize", {"messages": CHAT}).json()["count"]
    assert send(server, route).prompt_tokens == count
    longer = [*CHAT, {"role": "assistant", "content": "a tree"}, *CHAT]
    assert send(server, route, messages=longer).prompt_tokens > count


def check_role_or_content(field: str, other: str) -> Check:
    """The message's field reaches the prompt: other ids, and chat usage counts them."""

    def check(server, route: Route) -> None:
        def ids(**fields: Any) -> list[int]:
            messages = route.body(**fields)["messages"]
            return server.post("/tokenize", {"messages": messages}).json()["tokens"]

        assert ids() != ids(**{field: other})
        assert send(server, route, **{field: other}).prompt_tokens == len(ids(**{field: other}))

    return check


def check_name(server, route: Route) -> None:
    # the tiny model's template leaves names out: refused there, not dropped
    err = assert_error_body(server.post(route.path, route.body(name="ann")), 400)
    assert "name" in err["message"]


def check_rid(server, route: Route) -> None:
    assert send(server, route, rid="table-rid").raw["meta_info"]["id"] == "table-rid"


def check_cache_salt(server, route: Route) -> None:
    salt = f"salt-{route.path}"
    send(server, route, cache_salt=salt)
    cached = _cached(send(server, route, cache_salt=salt))
    assert cached > 0 and _cached(send(server, route, cache_salt=salt + "-other")) == 0


def _cached(out: Out) -> int:
    if "usage" in out.raw:
        return out.raw["usage"]["prompt_tokens_details"]["cached_tokens"]
    return out.raw["meta_info"]["cached_tokens"]


def check_bootstrap(server, route: Route) -> None:
    """Honoured by prefill and decode engines (tests/server/test_server_pd.py, real engines);
    an aggregated engine, like this one, refuses a room, and a host or port needs a room."""
    err = assert_error_body(server.post(route.path, route.body(bootstrap_room=7)), 400)
    assert err["param"] == "bootstrap_room" and "--disaggregation-mode" in err["message"], err
    for field, value in (("bootstrap_host", "127.0.0.1"), ("bootstrap_port", 8998)):
        err = assert_error_body(server.post(route.path, route.body(**{field: value})), 400)
        assert err["param"] == "bootstrap_room", err


def check_priority(server, route: Route) -> None:
    # orders requests only under priority scheduling (tested in test_sched_features); off here
    err = assert_error_body(server.post(route.path, route.body(priority=2)), 400)
    assert err["param"] == "priority"
    assert send(server, route, priority=0).texts


def check_sampling_params(server, route: Route) -> None:
    out = send(server, route, sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert out.completion_tokens == 2


def check_chat_flags(server, route: Route) -> None:
    opened = send(server, route).prompt_tokens
    assert send(server, route, add_generation_prompt=False).prompt_tokens < opened
    partial = [*CHAT, {"role": "assistant", "content": "an oak"}]
    cont = send(server, route, messages=partial, continue_final_message=True,
                add_generation_prompt=False).prompt_tokens  # fmt: skip
    assert cont < send(server, route, messages=partial, add_generation_prompt=False).prompt_tokens


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _tokens(server, **body: Any) -> int:
    reply = server.post("/tokenize", {"messages": CHAT, **body})
    assert reply.status == 200, reply.body
    return reply.json()["count"]


def check_tools(server, route: Route) -> None:
    """Tools reach the template (this tiny model's context is too short to generate with them:
    tests/server/test_server_tools.py runs the tool loop on SmolLM2)."""
    assert _tokens(server, tools=[TOOL]) > _tokens(server)
    bad = route.body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}})
    assert (
        assert_error_body(server.post(route.path, bad), 400)["param"] == "tool_choice.function.name"
    )


def check_tool_calls(server, route: Route) -> None:
    """A past call is written into the prompt; a tool result must name the call it answers."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [call]}]
    plain = [*CHAT, {"role": "assistant", "content": ""}]
    assert _tokens(server, messages=history) > _tokens(server, messages=plain)
    answer = {"role": "tool", "content": "1", "tool_call_id": "call_2"}
    reply = server.post(route.path, route.body() | {"messages": [*history, answer]})
    assert assert_error_body(reply, 400)["param"] == "messages.2.tool_call_id"


def check_template_kwargs(server, route: Route) -> None:
    """Variables the template does not use are refused, not dropped."""
    reply = server.post(route.path, route.body(chat_template_kwargs={"enable_thinking": True}))
    assert assert_error_body(reply, 400)["param"] == "chat_template_kwargs"


def in_tool_tests(server, route: Route) -> None:
    """Honoured on SmolLM2 in tests/server/test_server_tools.py (forced calls, one call only,
    reasoning apart), which this tiny model's 128-token context cannot hold."""


def in_thinking_test(server, route: Route) -> None:
    """A past assistant turn's reasoning goes to the template, which this tiny model's ignores:
    tests/server/test_server_anthropic.py renders it with a template that reads it (and sees a
    user message's refused)."""


def check_accepted(server, route: Route, **fields: Any) -> None:
    """Identifiers and tags that change nothing a model computes (OpenAI uses them for abuse
    monitoring, its own cache buckets and stored completions; the router reads routing_key)."""
    assert send(server, route, **fields).texts


HONOURED: dict[str, Check] = {
    "temperature": check_temperature,
    "top_p": check_top_p,
    "top_k": check_top_k,
    "seed": check_seed,
    "sampling_seed": lambda s, r: check_seed(s, r, "sampling_seed"),
    "stop": check_stop,
    "stop_token_ids": check_stop_token_ids,
    "ignore_eos": check_ignore_eos,
    "max_tokens": check_limit("max_tokens"),
    "max_completion_tokens": check_limit("max_completion_tokens"),
    "max_new_tokens": check_limit("max_new_tokens"),
    "n": check_n,
    "stream": check_stream,
    "stream_options": check_stream_options,
    "model": check_model,
    "prompt": check_prompt,
    "text": check_text_or_ids,
    "input_ids": check_text_or_ids,
    "messages": check_messages,
    "role": check_role_or_content("role", "system"),
    "content": check_role_or_content("content", "a much longer question about radix trees"),
    "name": check_name,
    "rid": check_rid,
    "cache_salt": check_cache_salt,
    "priority": check_priority,
    "sampling_params": check_sampling_params,
    "bootstrap_host": check_bootstrap,
    "bootstrap_port": check_bootstrap,
    "bootstrap_room": check_bootstrap,
    "add_generation_prompt": check_chat_flags,
    "continue_final_message": check_chat_flags,
    "tools": check_tools,
    "tool_calls": check_tool_calls,
    "tool_call_id": check_tool_calls,
    "chat_template_kwargs": check_template_kwargs,
    "tool_choice": in_tool_tests,
    "parallel_tool_calls": in_tool_tests,
    "separate_reasoning": in_tool_tests,
    "reasoning_content": in_thinking_test,
    "reasoning": in_thinking_test,
}
HONOURED |= make_checks(send, sampled, _limit)  # sampling, logprobs, structured output
# accepted and changing nothing the model computes, by definition (see check_accepted)
INFORMATIONAL = {"user": "u-1", "metadata": {"k": "v"}, "safety_identifier": "s-1",
                 "prompt_cache_key": "k-1", "prompt_cache_retention": "in_memory",
                 "routing_key": "tenant-1"}  # fmt: skip

FIELDS = [(model, name) for model in ROUTES for name in model.model_fields]


@pytest.mark.parametrize(("model", "field"), FIELDS,
                         ids=[f"{m.__name__}.{f}" for m, f in FIELDS])  # fmt: skip
def test_every_field_is_honoured_or_refused(tiny_server, model, field):
    route = ROUTES[model]
    why = body_fields.refused(model).get(field)
    if why is not None:
        reply = tiny_server.post(route.path, route.body(**{field: REFUSED_SAMPLE}))
        err = assert_error_body(reply, 400)
        assert err["param"] == route.param(field) and "not supported" in err["message"], err
        assert err["code"] == "unsupported_parameter"
    elif field in INFORMATIONAL:
        check_accepted(tiny_server, route, **{field: INFORMATIONAL[field]})
    else:
        assert field in HONOURED, (
            f"{model.__name__}.{field} is neither refused (declare it with "
            "body_fields.unsupported) nor honoured (add a check to HONOURED)"
        )
        HONOURED[field](tiny_server, route)


def test_a_refused_field_at_its_default_is_accepted(tiny_server):
    """Clients send defaults (the openai client sends none, others send all): those pass."""
    for model, route in ROUTES.items():
        for field in body_fields.refused(model):
            default = model.model_fields[field].default
            reply = tiny_server.post(route.path, route.body(**{field: default}))
            assert reply.status == 200, (model.__name__, field, reply.body)


# The current public schemas (OpenAI API reference; SGLang's sampling params doc and
# GenerateReqInput): every field must be declared, so that none is dropped unseen.
OPENAI_COMPLETIONS = """model prompt best_of echo frequency_penalty logit_bias logprobs max_tokens
    n presence_penalty seed stop stream stream_options suffix temperature top_p user"""
OPENAI_CHAT = """messages model audio frequency_penalty function_call functions logit_bias
    logprobs max_completion_tokens max_tokens metadata modalities n parallel_tool_calls
    prediction presence_penalty prompt_cache_key prompt_cache_retention reasoning_effort
    response_format safety_identifier seed service_tier stop store stream stream_options
    temperature tool_choice tools top_logprobs top_p user verbosity web_search_options"""
OPENAI_MESSAGE = "role content name tool_calls tool_call_id function_call refusal audio"
SGLANG_GENERATE = """text input_ids input_embeds image_data audio_data video_data
    sampling_params rid return_logprob logprob_start_len top_logprobs_num token_ids_logprob
    return_text_in_logprobs stream lora_path custom_logit_processor return_hidden_states
    session_params bootstrap_host bootstrap_port bootstrap_room data_parallel_rank priority"""
SGLANG_SAMPLING = """max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p
    ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim custom_params
    frequency_penalty presence_penalty repetition_penalty min_new_tokens json_schema regex ebnf
    structural_tag n sampling_seed logit_bias"""


@pytest.mark.parametrize(("model", "names"), [
    (protocol.CompletionRequest, OPENAI_COMPLETIONS),
    (protocol.ChatCompletionRequest, OPENAI_CHAT),
    (protocol.ChatMessage, OPENAI_MESSAGE),
    (protocol.GenerateRequest, SGLANG_GENERATE),
    (protocol.GenerateSampling, SGLANG_SAMPLING),
], ids=["completions", "chat", "message", "generate", "sampling_params"])  # fmt: skip
def test_every_field_of_the_public_schemas_is_declared(model, names):
    missing = set(names.split()) - set(model.model_fields)
    assert not missing, f"{model.__name__} lacks {sorted(missing)}"
