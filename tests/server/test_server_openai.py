"""The official `openai` client against `radixserve serve` on the tiny model: completions, chat,
streaming with usage, cached tokens on a repeated prompt, /v1/models, unknown models."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

# greedy, and never cut short by the random model's end-of-sequence token
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PROMPT = "the quick brown fox jumps over the lazy dog and"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a radix tree"}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client, tiny_server):
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_server.name]
    assert models[0].object == "model"


def test_completion_is_the_greedy_continuation(client, tiny_server):
    out = client.completions.create(model=tiny_server.name, prompt=PROMPT, max_tokens=8, **GREEDY)
    same = tiny_server.post("/generate", {"text": PROMPT, "sampling_params":
                            {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()  # fmt: skip
    assert out.object == "text_completion" and out.model == tiny_server.name
    assert len(out.choices) == 1
    assert out.choices[0].text == same["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == same["meta_info"]["prompt_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_completion_uses_the_chat_template(client, tiny_server):
    out = client.chat.completions.create(
        model=tiny_server.name, messages=CHAT, max_tokens=6, **GREEDY
    )
    msg = out.choices[0].message
    assert out.object == "chat.completion"
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    # the template wraps every message in <|im_start|>role ... <|im_end|>: many more tokens
    # than the two contents alone
    bare = tiny_server.post("/generate", {"text": "be brief a radix tree",
                            "sampling_params": {"max_new_tokens": 1}}).json()  # fmt: skip
    assert out.usage.prompt_tokens > bare["meta_info"]["prompt_tokens"] + 8


def test_streamed_chat_adds_up_to_the_whole(client, tiny_server):
    kw = {"model": tiny_server.name, "messages": CHAT, "max_tokens": 10, **GREEDY}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)  # not asked for


def test_streamed_completion_with_usage_and_cached_tokens(client, tiny_server):
    prompt = "a prompt sent twice shares its prefix cache: " + "ab cd " * 12
    kw = {"model": tiny_server.name, "prompt": prompt, "max_tokens": 5, **GREEDY}
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    *deltas, last = chunks
    assert "".join(c.choices[0].text for c in deltas) == whole.choices[0].text
    assert deltas[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in deltas)
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    # the second run of the same prompt finds all but its last token in the prefix cache
    assert 0 < last.usage.prompt_tokens_details.cached_tokens < last.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens >= last.usage.prompt_tokens - 1


def test_n_choices_and_a_batch_of_prompts(client, tiny_server):
    out = client.completions.create(
        model=tiny_server.name, prompt=[PROMPT, "a radix tree"], n=2, max_tokens=4, **GREEDY
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in out.choices}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the same text n times
    assert out.usage.completion_tokens == 16


def test_stop_and_seed_are_honoured(client, tiny_server):
    kw = {"model": tiny_server.name, "prompt": PROMPT, "max_tokens": 24}
    whole = client.completions.create(**kw, **GREEDY).choices[0].text
    stop = next(whole[i : i + 2] for i in range(3, len(whole) - 2) if whole[i : i + 2].strip())
    cut = client.completions.create(stop=[stop], **kw, **GREEDY).choices[0]
    assert cut.text == whole[: whole.index(stop)] and cut.finish_reason == "stop"
    sampled = [
        client.completions.create(temperature=1.0, seed=7, **kw).choices[0].text for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 404
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)


def test_bad_request_is_a_bad_request_error(client, tiny_server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=tiny_server.name, prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=tiny_server.name, prompt="fox " * 200, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"
