"""kv_aware's tokenization in the router equals the engine's (SmolLM2's real tokenizer and chat
template, and the simulator's), and a worker whose tokenizer differs is refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from radixserve.engine.tokenizer_manager import GenerateInput, TokenizerManager
from radixserve.router.policies.kv_aware import KvAwarePolicy
from radixserve.router.proxy.kv_setup import KvRouting, load_tokenizer, prompt_ids
from test_router_request_body import CHAT_CORPUS

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "prime."}]},
]  # fmt: skip


def engine_ids(tok, **inp) -> list[int]:
    """What the engine's tokenizer manager computes for the same prompt."""
    if inp.get("messages"):  # the server joins text parts before the engine sees them
        inp["messages"] = [
            {"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in inp["messages"]
        ]  # fmt: skip
    manager = SimpleNamespace(tokenizer=tok)  # the two methods tokenize uses, unbound
    manager.render_chat = lambda i: TokenizerManager.render_chat(manager, i)
    return list(TokenizerManager.tokenize(manager, GenerateInput(**inp)))  # an array since issue 16


@pytest.mark.parametrize("path", ["built-in:SmolLM2-135M", "sim:tiny-cpu"])
def test_router_tokenizes_as_the_engine(path):
    tok = load_tokenizer(path)
    text = "The capital of France is"
    assert prompt_ids({"text": text}, tok) == engine_ids(tok, text=text)
    assert prompt_ids({"prompt": [text, "other"]}, tok) == engine_ids(tok, text=text)
    assert prompt_ids({"messages": MESSAGES}, tok) == engine_ids(tok, messages=MESSAGES)
    assert prompt_ids({"input_ids": [5, 6, 7]}, tok) == [5, 6, 7]
    assert prompt_ids({"prompt": [[8, 9], [1]]}, tok) == [8, 9]
    assert prompt_ids({}, tok) is None


CONTINUED = [i for i, (body, _) in enumerate(CHAT_CORPUS) if body.get("continue_final_message")]


@pytest.mark.parametrize("case", CONTINUED)
def test_the_engine_continues_a_final_message_as_the_router_and_vllm(case):
    """continue_final_message in the engine's tokenizer manager: the ids the router computes
    (equal to transformers' rendering, which vLLM uses: test_router_request_body.py), even where
    the message's text also occurs in the template's markup, or is empty."""
    tok = load_tokenizer("built-in:SmolLM2-135M")
    body, normalised = CHAT_CORPUS[case]
    msgs = normalised or body["messages"]
    got = engine_ids(tok, messages=msgs, add_generation_prompt=False, continue_final_message=True)
    assert got == prompt_ids(body, tok)


def test_a_worker_with_another_tokenizer_is_refused():
    kv = KvRouting(KvAwarePolicy(), "sim:tiny-cpu")  # fingerprint sim:32000

    async def admit(fingerprint: str) -> bool:
        info = {"tokenizer_path": "sim:x", "vocab_size": 32000,
                "tokenizer_fingerprint": fingerprint}  # fmt: skip

        async def fetch(path: str):
            return info if path == "/get_model_info" else None

        ok = await kv.admit("w1", "http://127.0.0.1:1", fetch)
        await kv.stop()
        return ok

    assert asyncio.run(admit("hf:0123456789abcdef")) is False
    assert "http://127.0.0.1:1" in kv.refused
    kv = KvRouting(KvAwarePolicy(), "sim:tiny-cpu")
    assert asyncio.run(admit("sim:32000")) is True
