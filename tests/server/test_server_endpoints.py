"""vLLM's /tokenize and /detokenize, SGLang's /abort_request, request ids no client can take
from another, max_new_tokens 0 (prefill only), top_k 0 as off, and the chat flags
add_generation_prompt and continue_final_message, against `radixserve serve` on the tiny model."""

from __future__ import annotations

import threading
import time

import pytest

from server_harness import assert_error_body

PROMPT = "the quick brown fox jumps over the lazy dog and"
CHAT = [{"role": "user", "content": "name a tree"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def _generate(server, **body):
    reply = server.post("/generate", body)
    assert reply.status == 200, reply.body
    return reply.json()


def test_tokenize_gives_the_ids_generate_counts(tiny_server):
    out = tiny_server.post("/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    meta = _generate(tiny_server, input_ids=out["tokens"],
                     sampling_params={"max_new_tokens": 1})["meta_info"]  # fmt: skip
    assert out["count"] == len(out["tokens"]) == meta["prompt_tokens"]
    assert out["max_model_len"] == 128 and len(out["token_strs"]) == out["count"]
    assert _generate(tiny_server, text=PROMPT, sampling_params={"max_new_tokens": 1})[
        "meta_info"]["prompt_tokens"] == out["count"]  # fmt: skip
    back = tiny_server.post("/detokenize", {"tokens": out["tokens"]}).json()["prompt"]
    assert PROMPT in back
    plain = tiny_server.post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["count"] == out["count"] - 1  # the tiny Llama tokenizer adds one BOS


def test_tokenize_chat_matches_the_chat_completion_prompt(tiny_server):
    chat = {"messages": CHAT, "max_tokens": 1}
    used = tiny_server.post("/v1/chat/completions", chat).json()["usage"]["prompt_tokens"]
    assert tiny_server.post("/tokenize", {"messages": CHAT}).json()["count"] == used


def test_tokenize_and_detokenize_refuse_bad_input(tiny_server):
    assert_error_body(tiny_server.post("/tokenize", {}), 400)
    assert_error_body(tiny_server.post("/tokenize", {"prompt": "a", "messages": CHAT}), 400)
    err = assert_error_body(tiny_server.post("/detokenize", {"tokens": [10**9]}), 400)
    assert err["param"] == "tokens"
    err = assert_error_body(tiny_server.post("/tokenize", {"prompt": "a", "model": "nope"}), 404)
    assert err["param"] == "model"


def _long_request(server, rid: str, out: list) -> threading.Thread:
    body = {"text": PROMPT, "rid": rid, "sampling_params": {**GREEDY, "max_new_tokens": 90}}
    thread = threading.Thread(target=lambda: out.append(server.post("/generate", body)))
    thread.start()
    return thread


def test_abort_request_ends_a_running_request(tiny_server):
    for attempt in range(5):  # the tiny model may finish 90 tokens before the abort lands
        out: list = []
        rid = f"abort-me-{attempt}"
        thread = _long_request(tiny_server, rid, out)
        deadline = time.monotonic() + 10
        while tiny_server.stats()["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        aborted = tiny_server.post("/abort_request", {"rid": rid}).json()["aborted"]
        thread.join(30)
        assert out[0].status == 200, out[0].body
        meta = out[0].json()["meta_info"]
        if aborted:
            assert aborted == [rid] and meta["id"] == rid
            assert meta["finish_reason"]["type"] == "abort"
            assert meta["completion_tokens"] < 90
            assert tiny_server.wait_idle()["kv_usage"] == 0.0
            return
        assert meta["finish_reason"]["type"] == "length"  # it ran to its end first
    raise AssertionError("no request was still running when its abort arrived")


def test_abort_request_needs_a_rid_and_ignores_unknown_ones(tiny_server):
    assert_error_body(tiny_server.post("/abort_request", {}), 400)
    assert tiny_server.post("/abort_request", {"rid": "nobody"}).json()["aborted"] == []
    assert tiny_server.post("/abort_request", {"abort_all": True}).status == 200


def test_rids_in_the_servers_own_form_are_refused(tiny_server):
    own = _generate(tiny_server, text="a", sampling_params={"max_new_tokens": 1})
    server_rid = own["meta_info"]["id"]
    assert server_rid.startswith("rs-")
    for rid in (server_rid, "rs-1"):
        reply = tiny_server.post("/generate", {"text": "a", "rid": rid})
        assert assert_error_body(reply, 400)["param"] == "rid"


def test_batch_rids_are_one_per_prompt(tiny_server):
    out = _generate(tiny_server, text=["a", "b"], rid=["x-1", "x-2"],
                    sampling_params={"max_new_tokens": 1})  # fmt: skip
    assert [o["meta_info"]["id"] for o in out] == ["x-1", "x-2"]
    for rid in ("x", ["x-1"], ["x", "x"]):
        reply = tiny_server.post("/generate", {"text": ["a", "b"], "rid": rid})
        assert assert_error_body(reply, 400)["param"] == "rid"


def test_max_new_tokens_zero_prefills_and_caches_the_prompt(tiny_server):
    text = "warm this prompt into the cache: a prefix shared by many later requests"
    warm = _generate(tiny_server, text=text, sampling_params={"max_new_tokens": 0})
    assert warm["text"] == "" and warm["output_ids"] == []
    meta = warm["meta_info"]
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] > 10
    assert meta["finish_reason"]["type"] == "length"
    again = _generate(tiny_server, text=text, sampling_params={"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] >= meta["prompt_tokens"] - 1


def test_top_k_zero_and_minus_one_mean_off(tiny_server):
    def sample(**extra):
        params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
        return _generate(tiny_server, text=PROMPT, sampling_params={**params, **extra})["text"]

    off = sample()
    assert sample(top_k=0) == off and sample(top_k=-1) == off
    assert sample(top_k=1) != off  # top_k is honoured: 1 is greedy, a different text here
    chat = {"messages": CHAT, "max_tokens": 4, "top_k": 0}
    assert tiny_server.post("/v1/chat/completions", chat).status == 200


def _chat_ids(server, messages, **flags) -> list[int]:
    reply = server.post("/tokenize", {"messages": messages, **flags})
    assert reply.status == 200, reply.body
    return reply.json()["tokens"]


def test_add_generation_prompt_and_continue_final_message(tiny_server):
    opened = _chat_ids(tiny_server, CHAT)
    closed = _chat_ids(tiny_server, CHAT, add_generation_prompt=False)
    assert closed == opened[: len(closed)] and len(closed) < len(opened)
    partial = [*CHAT, {"role": "assistant", "content": "The oak is"}]
    cont = _chat_ids(tiny_server, partial, continue_final_message=True,
                     add_generation_prompt=False)  # fmt: skip
    ended = _chat_ids(tiny_server, partial, add_generation_prompt=False)
    tail = tiny_server.post("/detokenize", {"tokens": cont}).json()["prompt"]
    assert tail.endswith("The oak is") and len(cont) < len(ended) and cont == ended[: len(cont)]
    body = {"messages": partial, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 3, "temperature": 0}  # fmt: skip
    reply = tiny_server.post("/v1/chat/completions", body)
    assert reply.status == 200 and reply.json()["usage"]["prompt_tokens"] == len(cont)
    both = tiny_server.post("/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert "continue_final_message" in assert_error_body(both, 400)["message"]


def test_the_openai_client_sees_refusals_and_the_extensions(tiny_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    kw = {"model": tiny_server.name, "messages": CHAT, "max_tokens": 3}
    for field, value in (("reasoning_effort", "high"), ("store", True), ("service_tier", "flex"),
                         ("web_search_options", {})):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kw, **{field: value})
        assert err.value.param == field and err.value.code == "unsupported_parameter"
    partial = [*CHAT, {"role": "assistant", "content": "The oak is"}]
    out = client.chat.completions.create(**{**kw, "messages": partial}, temperature=0, user="u1",
                                         extra_body={"continue_final_message": True, "top_k": 0,
                                                     "add_generation_prompt": False})  # fmt: skip
    cont = _chat_ids(tiny_server, partial, continue_final_message=True,
                     add_generation_prompt=False)  # fmt: skip
    assert out.usage.prompt_tokens == len(cont) and out.choices[0].finish_reason == "length"
