"""Agent traffic through the router: chats with tools and Anthropic /v1/messages bodies reach the
worker byte for byte; kv_aware renders them (tools included) to the token ids a real `serve`
computes; and two agents sharing a long tool list land on the worker that holds it."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json

import pytest

pytest.importorskip("httptools")

from radixserve.router.policies.base import RequestView  # noqa: E402
from radixserve.router.policies.kv_aware import KvAwarePolicy  # noqa: E402
from radixserve.router.proxy.kv_setup import KvRouting, load_tokenizer, prompt_ids  # noqa: E402
from radixserve.router.proxy.request_body import routed_payload  # noqa: E402
from server_harness import ServerProcess  # noqa: E402
from test_router_app import FakeWorker, RouterThread  # noqa: E402
from test_router_fleet import RouterProc  # noqa: E402
from test_router_kv_procs import blocks, wait_for, worker  # noqa: E402


def tool(name: str, words: int = 12) -> dict:
    about = " ".join(f"{name}-detail{i}" for i in range(words))
    params = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    return {"type": "function",
            "function": {"name": name, "description": about, "parameters": params}}  # fmt: skip


TOOLS = [tool("read_file"), tool("write_file"), tool("run_tests")]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}  # fmt: skip
CHATS = [
    {"model": "m", "messages": [{"role": "user", "content": "Fix the bug."}], "tools": TOOLS},
    {"model": "m", "tools": TOOLS, "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the bug."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "def f(): return 1"},
    ]},
]  # fmt: skip
ANTHROPIC = {"model": "m", "max_tokens": 8, "system": "You are a coding agent.",
             "tools": [{"name": "read_file", "description": "Read a file.",
                        "input_schema": TOOLS[0]["function"]["parameters"]}],
             "messages": [
                 {"role": "user", "content": "Fix the bug."},
                 {"role": "assistant", "content": [
                     {"type": "text", "text": "Reading it."},
                     {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                      "input": {"path": "a.py"}}]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x = 1"},
                     {"type": "text", "text": "Go on."}]},
             ]}  # fmt: skip
ANTHROPIC_AS_CHAT = {"tools": [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": TOOLS[0]["function"]["parameters"]}}], "messages": [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug."},
    {"role": "assistant", "content": "Reading it.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "x = 1"},
    {"role": "user", "content": "Go on."},
]}  # fmt: skip
"""The OpenAI chat a user would write for ANTHROPIC, by hand."""


def test_tools_and_messages_bodies_reach_the_worker_byte_for_byte():
    w = FakeWorker("fw-agents")
    r = RouterThread([w.url], policy="cache_aware")
    try:
        for path, obj in [("/v1/chat/completions", CHATS[1]), ("/v1/messages", ANTHROPIC),
                          ("/v1/messages/count_tokens", ANTHROPIC)]:  # fmt: skip
            sent = json.dumps(obj, indent=3).encode()  # not how the router would write it
            conn = http.client.HTTPConnection(r.addr, timeout=20)
            conn.request("POST", path, body=sent, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            got = json.loads(resp.read())
            conn.close()
            assert resp.status == 200, (path, got)
            assert got["body_sha256"] == hashlib.sha256(sent).hexdigest(), path
    finally:
        r.stop()
        w.kill()


@pytest.fixture(scope="module")
def smollm2():
    server = ServerProcess(["--max-total-tokens", "4096"])
    yield server
    server.stop()


def engine_tokens(server: ServerProcess, body: dict) -> list[int]:
    keep = ("messages", "tools", "add_generation_prompt", "chat_template_kwargs")
    reply = server.post("/tokenize", {k: body[k] for k in keep if k in body})
    assert reply.status == 200, reply.body
    return reply.json()["tokens"]


def test_the_router_renders_tools_and_messages_as_the_engine(smollm2):
    """The router's ids for chats with tools (and past calls and results) are the ids a real
    `serve` with SmolLM2 gives on /tokenize; those of a /v1/messages body are the ids of the
    same chat written for OpenAI, and as many as /v1/messages/count_tokens counts."""
    tok = load_tokenizer("built-in:SmolLM2-135M")
    for body in CHATS:
        ids = prompt_ids(body, tok)
        assert ids == engine_tokens(smollm2, body)
        no_tools = prompt_ids({**body, "tools": None}, tok)
        assert no_tools is not None and len(ids) > len(no_tools) + 60  # the tools are in it
    ids = prompt_ids(routed_payload(ANTHROPIC, "/v1/messages"), tok)
    assert ids == engine_tokens(smollm2, ANTHROPIC_AS_CHAT)
    body = {k: v for k, v in ANTHROPIC.items() if k != "max_tokens"} | {"model": smollm2.name}
    counted = smollm2.post("/v1/messages/count_tokens", body)
    assert counted.status == 200, counted.body
    assert counted.json()["input_tokens"] == len(ids)


def test_a_template_variable_the_engine_refuses_routes_untokenized():
    """chat_template_kwargs are rendered as the engine renders them; one SmolLM2's template
    does not use is refused by the server, so the router routes it without token ids."""
    tok = load_tokenizer("built-in:SmolLM2-135M")
    assert prompt_ids({**CHATS[0], "chat_template_kwargs": {"enable_thinking": False}}, tok) is None


def agent(turn: str) -> dict:
    tools = [tool(f"tool{i}", 40) for i in range(6)]  # 360 tokens on --sim
    return {"model": "sim-tiny-cpu", "max_tokens": 1, "tools": tools,
            "messages": [{"role": "user", "content": turn}]}  # fmt: skip


def test_agents_sharing_a_tool_list_go_to_the_worker_holding_it():
    """Under kv_aware, a second agent with the first one's tools but another task goes where
    the tool list is cached, and the router expected the hit: it renders the tools."""
    procs = [worker() for _ in range(3)]
    try:
        router = RouterProc([w.url for w in procs], "--policy", "kv_aware")
        procs.append(router)
        status, reply = router.call("POST", "/v1/chat/completions", agent("Fix bug 1 in a.py."))
        assert status == 200, reply
        [first] = [u for u, n in router.requests_per_worker().items() if n]
        wait_for(lambda: blocks(router, first) >= 20, "the tool list's blocks")
        before = router.metrics()["kv_expected_hit_tokens_total"]
        status, reply = router.call("POST", "/v1/chat/completions", agent("Add a test for b."))
        assert status == 200, reply
        assert router.requests_per_worker()[first] == 2
        assert router.metrics()["kv_expected_hit_tokens_total"] - before >= 320
    finally:
        for p in reversed(procs):
            p.stop()


def test_behind_vllm_workers_a_chat_is_rendered_as_vllm_renders_it():
    """SmolLM2's template renders no tools: vLLM hands them to it all the same (so they are
    dropped), radixserve lists them in a system turn. A router admitting a vLLM worker renders
    as vLLM (its /tokenize agrees: test_router_vllm.py)."""
    tok = load_tokenizer("built-in:SmolLM2-135M")
    plain = {**CHATS[0], "tools": None}
    assert prompt_ids(CHATS[0], tok, "vllm") == prompt_ids(plain, tok, "vllm")
    kv = KvRouting(KvAwarePolicy(), subscribe=False)
    kv._adopt(tok)

    async def fetch(path: str) -> None:
        return None

    view = RequestView.from_prompt(None, None, "m", "", "")
    assert kv.tokenized(CHATS[0], view)[0].token_ids == prompt_ids(CHATS[0], tok)
    assert asyncio.run(kv.admit("w0", "http://w0", fetch, "vllm"))
    assert kv.tokenized(CHATS[0], view)[0].token_ids == prompt_ids(plain, tok)


def fetcher(server: ServerProcess):
    async def fetch(path: str) -> dict | None:
        reply = server.get(path)
        return reply.json() if reply.status == 200 else None

    return fetch


def test_the_router_renders_tools_in_the_format_each_worker_says_and_refuses_a_mix(smollm2):
    """A worker started with --tool-call-parser hermes writes its default tools prompt in
    hermes's format, and says so in /get_model_info: a kv_aware router admitting it renders
    chats with tools the same way (its /tokenize agrees). A worker that renders otherwise
    (SmolLM2's own format, or vLLM's transformers form) is refused, saying why."""
    hermes = ServerProcess(["--max-total-tokens", "4096", "--tool-call-parser", "hermes"])
    try:
        assert hermes.get("/get_model_info").json()["tool_call_parser"] == "hermes"
        kv = KvRouting(KvAwarePolicy(), subscribe=False)
        assert asyncio.run(kv.admit("w0", hermes.url, fetcher(hermes), "radixserve"))
        view = RequestView.from_prompt(None, None, "m", "", "")
        for body in CHATS:
            ids = kv.tokenized(body, view)[0].token_ids
            assert ids == engine_tokens(hermes, body) != engine_tokens(smollm2, body)
        assert not asyncio.run(kv.admit("w1", smollm2.url, fetcher(smollm2), "radixserve"))
        assert "--tool-call-parser smollm2" in kv.refused[smollm2.url]
        assert "--tool-call-parser hermes" in kv.refused[smollm2.url]
        assert not asyncio.run(kv.admit("w2", "http://v", fetcher(hermes), "vllm"))
        assert "vllm" in kv.refused["http://v"]
        asyncio.run(kv.forget("w0"))  # the fleet is empty: the next worker sets the way
        assert asyncio.run(kv.admit("w1", smollm2.url, fetcher(smollm2), "radixserve"))
        assert kv.tokenized(CHATS[1], view)[0].token_ids == engine_tokens(smollm2, CHATS[1])
    finally:
        hermes.stop()
