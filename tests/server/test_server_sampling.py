"""Sampling fields users of vLLM and SGLang rely on, over HTTP on the tiny model: logit_bias,
min_tokens, n with distinct seeds, stop strings kept in the output, skip_special_tokens, and a
--sim server that refuses what it cannot honour. Each test fails if its field were ignored."""

from __future__ import annotations

import json

import pytest

from server_harness import ServerProcess, assert_error_body

PROMPT = "the quick brown fox jumps over the lazy dog and"
EOS = {"1": 100, "3": 100}  # the tiny model's </s> and <|im_end|>: make the end most likely
IM_START = 2  # a special token that is not an end of sequence


def generate(server, **sampling) -> dict:
    reply = server.post("/generate", {"text": PROMPT, "sampling_params": sampling})
    assert reply.status == 200, reply.body[:500]
    return reply.json()


def test_logit_bias_minus_100_bans_the_greedy_token(tiny_server):
    first = generate(tiny_server, max_new_tokens=1, temperature=0)["output_ids"][0]
    banned = generate(tiny_server, max_new_tokens=1, temperature=0, logit_bias={str(first): -100})
    assert banned["output_ids"][0] != first
    forced = generate(tiny_server, max_new_tokens=4, temperature=1.0, logit_bias={"77": 100})
    assert forced["output_ids"] == [77] * 4


def test_logit_bias_is_validated(tiny_server):
    for bias in ({"abc": 1}, {"5": "x"}, {"5": 101}, {"99999": 1}):
        body = {"prompt": PROMPT, "max_tokens": 2, "logit_bias": bias}
        err = assert_error_body(tiny_server.post("/v1/completions", body), 400)
        assert err["param"].startswith("logit_bias"), err


def test_min_tokens_holds_the_end_of_sequence_back(tiny_server):
    ended = generate(tiny_server, max_new_tokens=20, temperature=0, logit_bias=EOS)
    assert ended["meta_info"]["completion_tokens"] == 1
    assert ended["meta_info"]["finish_reason"]["type"] == "stop"
    held = generate(tiny_server, max_new_tokens=20, temperature=0, logit_bias=EOS,
                    min_new_tokens=6)  # fmt: skip
    assert held["meta_info"]["completion_tokens"] == 7  # six held back, then the end
    assert held["meta_info"]["finish_reason"]["type"] == "stop"
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "logit_bias": EOS,
            "min_tokens": 3}  # fmt: skip
    out = tiny_server.post("/v1/completions", body).json()
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "stop"


def test_n_choices_with_a_seed_differ_and_each_is_seed_plus_i(tiny_server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3,
            "ignore_eos": True}  # fmt: skip
    texts = [c["text"] for c in tiny_server.post("/v1/completions", body).json()["choices"]]
    assert len(set(texts)) == 3
    for i, text in enumerate(texts):
        alone = {**body, "n": 1, "seed": 11 + i}
        assert tiny_server.post("/v1/completions", alone).json()["choices"][0]["text"] == text


def test_stop_string_kept_with_include_stop_str_in_output_and_no_stop_trim(tiny_server):
    whole = generate(tiny_server, max_new_tokens=24, temperature=0, ignore_eos=True)["text"]
    stop = next(whole[i : i + 2] for i in range(3, len(whole) - 2) if whole[i : i + 2].strip())
    cut = whole[: whole.index(stop)]
    base = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    assert generate(tiny_server, **base)["text"] == cut
    assert generate(tiny_server, **base, no_stop_trim=True)["text"] == cut + stop
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stop": [stop], "include_stop_str_in_output": True}  # fmt: skip
    assert tiny_server.post("/v1/completions", body).json()["choices"][0]["text"] == cut + stop


def test_skip_special_tokens_false_shows_them(tiny_server):
    kw = {"max_new_tokens": 3, "temperature": 0, "logit_bias": {str(IM_START): 100}}
    assert generate(tiny_server, **kw)["text"] == ""
    assert generate(tiny_server, **kw, skip_special_tokens=False)["text"] == "<|im_start|>" * 3


def test_best_of_above_n_is_refused_by_name(tiny_server):
    body = {"prompt": PROMPT, "max_tokens": 2, "best_of": 3}
    assert assert_error_body(tiny_server.post("/v1/completions", body), 400)["param"] == "best_of"


@pytest.fixture(scope="module")
def sim_server():
    server = ServerProcess(["--sim", "tiny-cpu"])
    yield server
    server.stop()


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"logit_bias": {"5": 3}}, "logit_bias"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/generate", {"regex": "[a-z]+"}, "grammar"),
        ("/generate", {"min_p": 0.1}, "min_p"),
    ],
)
def test_sim_server_refuses_what_needs_logits(sim_server, path, extra, param):
    if path == "/generate":
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, **extra}}
    elif path == "/v1/completions":
        body = {"prompt": PROMPT, "max_tokens": 2, **extra}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    err = assert_error_body(sim_server.post(path, body), 400)
    assert err["param"] == param and "--sim" in err["message"]
    # what it can honour, it does: min_tokens on the simulated runner
    ok = sim_server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "min_tokens": 2})
    assert ok.status == 200


def test_response_format_json_schema_through_the_openai_client(tiny_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
              "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    for seed in range(3):
        out = client.chat.completions.create(
            model=tiny_server.name, messages=[{"role": "user", "content": "yes or no?"}],
            max_tokens=60, temperature=1.0, seed=seed, response_format=fmt,
        )  # fmt: skip
        value = json.loads(out.choices[0].message.content)
        assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9
        assert set(value) == {"answer", "score"} and out.choices[0].finish_reason == "stop"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": bad}
    err = assert_error_body(tiny_server.post("/v1/chat/completions", body), 400)
    assert "json_schema" in err["message"]


def test_a_stop_token_leaves_no_text_unless_kept(tiny_server):
    whole = generate(tiny_server, max_new_tokens=12, temperature=0, ignore_eos=True)
    ids = whole["output_ids"]
    stop = next(t for t in ids[2:] if tiny_server.post("/detokenize", {"tokens": [t]}).json()
                ["prompt"].strip())  # fmt: skip
    at = ids.index(stop)
    kw = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]}
    cut, kept = generate(tiny_server, **kw), generate(tiny_server, **kw, no_stop_trim=True)
    assert cut["output_ids"] == kept["output_ids"] == ids[: at + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert kept["text"].startswith(cut["text"]) and len(kept["text"]) > len(cut["text"])
