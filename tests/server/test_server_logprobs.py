"""Log probabilities over HTTP on the tiny model, in the shapes the `openai` client and SGLang's
docs expect, equal to transformers' log-softmax on the same weights within 1e-4: /generate's
return_logprob / top_logprobs_num / logprob_start_len, chat logprobs / top_logprobs,
completions logprobs and echo; and prompt logprobs that stay right on a cached prefix."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from radixserve.modelfiles.tokenizer import load_model_info  # noqa: E402
from server_harness import assert_error_body  # noqa: E402

PROMPT = "the capital of france is paris and the capital of italy"
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Log-softmax rows of transformers' model for a token sequence: row p predicts p + 1."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def info(tiny_model_dir):
    return load_model_info(tiny_model_dir)


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL


def check_tokens(ref: torch.Tensor, ids: list[int], start: int, got: list[float | None]):
    """``got[j]`` is the logprob of ``ids[start + j]``; None only for position 0."""
    for j, value in enumerate(got):
        p = start + j
        if p == 0:
            assert value is None
            continue
        assert close(value, ref[p - 1, ids[p]].item()), (p, value, ref[p - 1, ids[p]].item())


def test_generate_input_and_output_logprobs_match_transformers(tiny_server, reference, info):
    body = {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 3, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.7, "seed": 3,
                                "ignore_eos": True}}  # fmt: skip
    out = tiny_server.post("/generate", body).json()
    meta = out["meta_info"]
    prompt = info.encode(PROMPT)
    ids = prompt + out["output_ids"]
    ref = reference(ids)
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [t[1] for t in inputs] == prompt and [t[1] for t in outputs] == out["output_ids"]
    assert outputs[0][2] == info.decode(out["output_ids"][:1], skip_special_tokens=False)
    check_tokens(ref, ids, 0, [t[0] for t in inputs + outputs])
    # top 3 of every position: transformers' top 3, best first
    tops = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]
    for p, top in enumerate(tops, start=1):
        values, best = ref[p - 1].topk(3)
        assert [t[1] for t in top] == best.tolist()
        assert all(close(t[0], v) for t, v in zip(top, values.tolist()))
    # logprob_start_len: only from there on; -1 (the default): none of the prompt
    later = tiny_server.post("/generate", {**body, "logprob_start_len": 5}).json()["meta_info"]
    assert [t[1] for t in later["input_token_logprobs"]] == prompt[5:]
    check_tokens(ref, ids, 5, [t[0] for t in later["input_token_logprobs"]])
    none = tiny_server.post("/generate", {**body, "logprob_start_len": -1}).json()["meta_info"]
    assert none["input_token_logprobs"] == [] and len(none["output_token_logprobs"]) == 6


def test_chat_logprobs_parse_in_the_openai_client(client, tiny_server, reference, info):
    messages = [{"role": "user", "content": "a radix tree"}]
    out = client.chat.completions.create(
        model=tiny_server.name, messages=messages, max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    prompt = info.encode(info.apply_chat_template(messages), add_special_tokens=False)
    assert len(prompt) == out.usage.prompt_tokens
    same = tiny_server.post("/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]  # fmt: skip
    assert [c.token for c in content] == [info.decode([t], False) for t in same]
    ids = prompt + same
    ref = reference(ids)
    check_tokens(ref, ids, len(prompt), [c.logprob for c in content])
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob  # greedy
        assert bytes(c.bytes) == c.token.encode()
    streamed = client.chat.completions.create(
        model=tiny_server.name, messages=messages, max_tokens=5, temperature=0, stream=True,
        logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    lps = [x.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
           for x in ch.choices[0].logprobs.content]  # fmt: skip
    # the second request hits the prefix cache, the first computed the whole prompt: equal
    # within the README's 1e-4, not bit for bit (another CPU rounds the two paths apart)
    assert len(lps) == len(content) and all(map(close, lps, [c.logprob for c in content]))


def test_top_logprobs_without_logprobs_is_refused(tiny_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2, "max_tokens": 2}
    err = assert_error_body(tiny_server.post("/v1/chat/completions", body), 400)
    assert err["param"] == "top_logprobs"


def test_completion_echo_with_logprobs_on_a_cached_prompt(client, tiny_server, reference, info):
    """The prompt is cached first; asking for its logprobs then computes it again for that
    request (a cached prefix has no logits), so the values stay exact."""
    prompt = PROMPT + " is rome and the capital of spain"
    kw = {"model": tiny_server.name, "prompt": prompt, "max_tokens": 3, "temperature": 0,
          "extra_body": {"ignore_eos": True}}  # fmt: skip
    warm = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix is in the cache
    out = client.completions.create(echo=True, logprobs=2, **kw)
    choice = out.choices[0]
    assert choice.text == prompt + warm.choices[0].text
    ids = info.encode(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) == 2
    assert "".join(lp.tokens[1:]) == choice.text and lp.text_offset[:2] == [0, 0]
    assert lp.text_offset[-1] == len(choice.text) - len(lp.tokens[-1])
    full = ids + again_ids(tiny_server, ids)
    assert lp.tokens[len(ids) :] == [info.decode([t], False) for t in full[len(ids) :]]
    check_tokens(reference(full), full, 0, lp.token_logprobs)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # recomputed, as documented
    plain = client.completions.create(logprobs=0, **kw).choices[0].logprobs
    assert len(plain.tokens) == 3
    assert all(map(close, plain.token_logprobs, lp.token_logprobs[len(ids) :]))


def again_ids(server, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
            "ignore_eos": True}}  # fmt: skip
    return server.post("/generate", body).json()["output_ids"]


def test_prompt_scoring_with_max_new_tokens_0(tiny_server, reference, info):
    """SGLang's way to score a prompt: prefill only, input logprobs, no output."""
    body = {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    meta = tiny_server.post("/generate", body).json()["meta_info"]
    ids = info.encode(PROMPT)
    assert meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0
    check_tokens(reference(ids), ids, 0, [t[0] for t in meta["input_token_logprobs"]])


def test_streamed_completion_echo_and_logprobs_add_up_to_the_whole(client, tiny_server):
    kw = {"model": tiny_server.name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
          "echo": True, "logprobs": 1, "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert "".join(c.text for c in chunks) == whole.text and whole.text.startswith(PROMPT)
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    # two requests (the second's prompt from the cache), so within the tolerance
    assert len(streamed) == len(whole.logprobs.token_logprobs)
    assert streamed[0] is None and whole.logprobs.token_logprobs[0] is None
    assert all(map(close, streamed[1:], whole.logprobs.token_logprobs[1:]))
    offsets = [v for c in chunks if c.logprobs for v in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
