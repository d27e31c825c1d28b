"""SimRunner: reproducible tokens whatever the cache did, durations from the cost model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from radixserve.sched.batch import Batch, BatchEntry
from radixserve.sched.request import SamplingParams
from radixserve.sim.costmodel import get_cost_model
from radixserve.sim.runner import SimRunner, step_entries

PROMPT = [5, 17, 99, 3, 42, 7, 8, 1000]


def entry(ids: list[int], start: int, sample: bool = True, prefill: bool = True) -> BatchEntry:
    slots = list(range(start + len(ids)))
    return BatchEntry("r", ids, start, slots, sample, SamplingParams(), prefill)


def test_one_token_per_sampled_entry_and_duration_from_the_cost_model() -> None:
    runner = SimRunner("llama3-8b-h100")
    batch = Batch([entry(PROMPT[:4], 0, sample=False), entry([7], 9, prefill=False)])
    result = runner.run(batch)
    assert result.next_token_ids[0] is None
    assert isinstance(result.next_token_ids[1], int)
    expected = get_cost_model("llama3-8b-h100").step_time([(4, 0, True), (1, 9, False)])
    assert result.duration == pytest.approx(expected)
    assert step_entries(batch) == [(4, 0, True), (1, 9, False)]


def test_next_token_depends_only_on_the_context() -> None:
    whole = SimRunner().run(Batch([entry(PROMPT, 0)])).next_token_ids[0]
    cached = SimRunner().run(Batch([entry(PROMPT[5:], 5)])).next_token_ids[0]
    chunked = SimRunner().run(Batch([entry(PROMPT[6:], 6)])).next_token_ids[0]
    assert whole == cached == chunked
    assert SimRunner(seed=1).run(Batch([entry(PROMPT, 0)])).next_token_ids[0] != whole


def test_generate_matches_step_by_step_decoding() -> None:
    runner = SimRunner(vocab_size=100)
    out = runner.generate(PROMPT, 20)
    ids = list(PROMPT)
    for _ in range(20):
        e = entry(ids[-1:], len(ids) - 1, prefill=False)
        ids.append(runner.run(Batch([e])).next_token_ids[0])
    assert ids[len(PROMPT) :] == out
    assert all(0 <= t < 100 for t in out)


def test_eos_is_avoided_unless_asked_for() -> None:
    assert set(SimRunner(vocab_size=2, eos_token_id=0).generate([1], 200)) == {1}
    assert SimRunner(vocab_size=2, eos_token_id=0, eos_prob=1.0).generate([1], 5) == [0]
    some = SimRunner(eos_token_id=0, eos_prob=0.05)
    lengths = [len(some.generate([p], 1000)) for p in range(50)]
    assert 5 < sum(lengths) / len(lengths) < 60  # about 1 / 0.05 tokens


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        SimRunner(vocab_size=1)
    with pytest.raises(ValueError):
        SimRunner(eos_prob=0.5)  # no eos_token_id to produce
    with pytest.raises(ValueError):
        SimRunner("no-such-gpu")


def test_sim_modules_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import radixserve.sim.costmodel, radixserve.sim.runner, radixserve.sim.workloads\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
