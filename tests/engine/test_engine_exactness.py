"""The real Scheduler driving the real model: prefix reuse, batching, chunked prefill, pages and
retraction change no greedy output (tiny random-weight Llama-3 and Qwen2 through the loader)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")

from radixserve.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.request import Req, SamplingParams  # noqa: E402
from radixserve.sched.scheduler import Scheduler  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

POOL = 1024
rng = random.Random(5)
SYSTEM = [rng.randrange(4, 300) for _ in range(40)]
PROMPTS = [SYSTEM + [rng.randrange(4, 300) for _ in range(3 + 4 * i)] for i in range(6)]
PROMPTS += [[rng.randrange(4, 300) for _ in range(30)], PROMPTS[0][:20]]
NEW = [8 + 3 * i for i in range(len(PROMPTS))]


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def runner(request, tmp_path_factory):
    path = build_tiny_model(request.param, tmp_path_factory.mktemp("tiny"))
    return TorchRunner(ModelConfig(model=str(path)), num_slots=POOL)


def run_all(runner, s: Scheduler, prompts, tag: str, new=NEW) -> list[Req]:
    """Add every prompt (greedy, EOS ignored) and step ``s`` until it is idle."""
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=new[i], temperature=0.0, ignore_eos=True)
        s.add_request(Req(f"{tag}{i}", list(p), sp))
    reqs = [s.get(f"{tag}{i}") for i in range(len(prompts))]
    while (batch := s.step()) is not None:
        s.on_output(batch, runner.run(batch))
        s.check_integrity()
    return reqs


def serve(runner, prompts, sched: SchedulerConfig, cache: CacheConfig, tag: str, new=NEW):
    """Run every prompt to completion on a fresh scheduler; returns the drained scheduler."""
    s = Scheduler(sched, cache, eos_token_ids=runner.info.eos_token_ids)
    s.outputs = [list(r.output_ids) for r in run_all(runner, s, prompts, tag, new)]  # type: ignore[attr-defined]
    return s


@pytest.fixture(scope="module")
def reference(runner):
    cache = CacheConfig(max_total_tokens=POOL, disable_radix_cache=True)
    return [
        serve(runner, [p], SchedulerConfig(), cache, f"ref{i}-", [NEW[i]]).outputs[0]
        for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("chunk", [-1, 16])
def test_batched_cached_chunked_paged_equals_alone(runner, reference, page, chunk):
    sched = SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 64) * 4)
    cache = CacheConfig(max_total_tokens=POOL, page_size=page)
    cold = serve(runner, PROMPTS, sched, cache, "a")
    assert cold.outputs == reference
    # the same scheduler again: now the prompts (and earlier outputs) are in the tree
    warm = cold
    reqs = run_all(runner, warm, PROMPTS, "b")
    assert [r.output_ids for r in reqs] == reference
    assert all(r.cached_tokens >= len(p) - page - 1 for r, p in zip(reqs, PROMPTS))
    assert warm.stats().cached_prompt_tokens > 0


def test_retraction_changes_no_output(runner, reference):
    # a pool far too small for every request's whole output, and a reserve too low to see it
    sched = SchedulerConfig(new_token_ratio=0.02, min_new_token_ratio=0.02)
    s = serve(runner, PROMPTS, sched, CacheConfig(max_total_tokens=170), "r")
    assert s.stats().num_retracted > 0
    assert s.outputs == reference
    assert s.flush_cache() and s.allocator.available() == 170
