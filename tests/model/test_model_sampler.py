"""Sampling: greedy, temperature, top-k, top-p, and seeds that survive a retraction."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.model.sampler import Sampler  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from radixserve.sched.request import SamplingParams  # noqa: E402
from tiny_models import SlotAllocator, build_tiny_model, entry  # noqa: E402

LOGITS = torch.tensor([[0.0, 3.0, 2.5, 1.0, -1.0, 2.9]])


def draws(sampler: Sampler, params: SamplingParams, n: int, logits=LOGITS) -> list[int]:
    return [sampler.sample(logits, [params], [i])[0] for i in range(n)]


def test_greedy_and_its_equivalents_pick_the_argmax():
    s = Sampler(0)
    assert draws(s, SamplingParams(temperature=0.0), 5) == [1] * 5
    assert draws(s, SamplingParams(top_k=1), 5) == [1] * 5
    assert draws(s, SamplingParams(top_p=0.01), 20) == [1] * 20


def test_top_k_and_top_p_restrict_the_support():
    s = Sampler(0)
    assert set(draws(s, SamplingParams(top_k=2), 200)) == {1, 5}
    # softmax mass: 1 -> ~0.36, 5 -> ~0.33, 2 -> ~0.22: top_p 0.6 keeps exactly tokens 1 and 5
    assert set(draws(s, SamplingParams(top_p=0.6), 200)) == {1, 5}
    assert set(draws(s, SamplingParams(temperature=5.0), 400)) == set(range(6))


def test_frequencies_follow_the_softmax():
    s = Sampler(0)
    n = 3000
    counts = torch.bincount(torch.tensor(draws(s, SamplingParams(), n)), minlength=6)
    expected = torch.softmax(LOGITS[0], dim=-1) * n
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)


def test_seeded_draw_depends_only_on_seed_step_and_logits():
    p = SamplingParams(seed=1234)
    a = [Sampler(1).sample(LOGITS, [p], [i])[0] for i in range(30)]
    b = [
        Sampler(2).sample(LOGITS.repeat(3, 1), [SamplingParams(), p, p], [0, i, i])[1:]
        for i in range(30)
    ]
    assert all(x == y == z for x, (y, z) in zip(a, b))
    assert len(set(a)) > 1
    assert a != draws(Sampler(1), SamplingParams(seed=4321), 30)


def test_unseeded_runs_repeat_with_the_runner_seed():
    p = SamplingParams()
    assert draws(Sampler(7), p, 30) == draws(Sampler(7), p, 30)
    assert draws(Sampler(7), p, 30) != draws(Sampler(8), p, 30)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = build_tiny_model("llama3", tmp_path_factory.mktemp("tiny"))
    return TorchRunner(ModelConfig(model=str(path)), num_slots=256)


def test_retracted_seeded_request_resamples_the_same_tokens(runner):
    """A request retracted after 4 tokens and recomputed (prompt + output, new slots, new batch
    companions) continues exactly as if it had never been interrupted."""
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=99)
    prompt = [0, 12, 77, 140, 3]
    whole = _sample(runner, prompt, [], params, 10, SlotAllocator(256, seed=1))
    resumed = _sample(runner, prompt, whole[:4], params, 6, SlotAllocator(256, seed=2))
    assert whole[4:] == resumed
    assert len(set(whole)) > 2


def _sample(runner, prompt, done, params, steps, alloc) -> list[int]:
    """Prefill ``prompt + done`` (alongside an unrelated greedy request), then decode."""
    tokens = prompt + done
    slots = alloc.take(len(tokens))
    other = entry("other", [0, 5, 9], 0, alloc.take(3))
    first = entry("r", tokens, 0, slots, sampling=params, num_generated=len(done))
    out = [runner.run(Batch([other, first])).next_token_ids[1]]
    for _ in range(steps - 1):
        slots += alloc.take(1)
        n = len(done) + len(out)
        e = entry("r", out[-1:], len(prompt) + n - 1, slots, sampling=params, num_generated=n)
        out.append(runner.run(Batch([e])).next_token_ids[0])
    return out
