"""The Python API honours the sampling, logprob and grammar parameters as /generate does (SGLang's
names): a JSON schema that parses, logprobs in meta_info, a logit_bias dict, min_new_tokens."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("xgrammar")

from radixserve import Engine  # noqa: E402
from radixserve.engine.engine import sampling_from  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine(model=str(tiny_model_dir), max_total_tokens=2048, context_length=128) as e:
        yield e


def test_engine_generate_with_grammar_logprobs_bias_and_min_tokens(engine):
    out = engine.generate("the quick brown fox", {
        "max_new_tokens": 30, "temperature": 1.0, "seed": 4, "json_schema": json.dumps(SCHEMA),
        "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0})  # fmt: skip
    assert isinstance(json.loads(out["text"])["ok"], bool)
    meta = out["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(t[0] <= 0 for t in meta["output_token_logprobs"])
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    forced = engine.generate("the quick brown fox", {"max_new_tokens": 3, "logit_bias": {77: 100}})
    assert forced["output_ids"] == [77, 77, 77]
    held = engine.generate("the quick brown fox", {"max_new_tokens": 9, "temperature": 0,
                                                   "logit_bias": {1: 100, 3: 100},
                                                   "min_new_tokens": 4})  # fmt: skip
    assert held["meta_info"]["completion_tokens"] == 5


def test_engine_async_generate_streams_logprobs(engine):
    import asyncio

    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "return_logprob": True}

    async def chunks() -> list[dict]:
        return [
            c async for c in await engine.async_generate("the quick brown fox", sp, stream=True)
        ]

    streamed = asyncio.run(chunks())
    whole = engine.generate("the quick brown fox", sp)["meta_info"]["output_token_logprobs"]
    # each chunk carries the logprobs of every token so far, as its text and output_ids
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in streamed] == [1, 2, 3, 4, 5]
    got = streamed[-1]["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in got] == [t[1] for t in whole] == streamed[-1]["output_ids"]
    assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(got, whole))


def test_a_sim_engine_refuses_what_needs_logits():
    with Engine(sim="tiny-cpu") as sim:
        with pytest.raises(ValueError, match="presence_penalty"):
            sim.generate("hello", {"max_new_tokens": 2, "presence_penalty": 0.5})
        with pytest.raises(ValueError, match="grammar"):
            sim.generate("hello", {"max_new_tokens": 2, "regex": "[a-z]+"})
        out = sim.generate("hello", {"max_new_tokens": 3, "min_new_tokens": 2})
        assert out["meta_info"]["completion_tokens"] >= 2


def test_sampling_from_refuses_two_grammars():
    assert sampling_from({"regex": "[a-z]+"}).grammar == ("regex", "[a-z]+")
    with pytest.raises(ValueError, match="at most one"):
        sampling_from({"json_schema": json.dumps(SCHEMA), "regex": "[a-z]+"})
    with pytest.raises(ValueError, match="at most one"):
        sampling_from({"regex": "[a-z]+", "grammar": ("json", "")})
