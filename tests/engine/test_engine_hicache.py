"""The host tier with the real model: a small device pool forces a prompt's KV out to host
memory, and a later request sharing its prefix loads it back instead of computing it; greedy
outputs equal recomputation and logprobs agree within 1e-4 (tiny random-weight models through
the loader; the last test through the real engine processes and their meta_info)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")

from radixserve.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from radixserve.model.host_pool import HostKVPool  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.request import Req, SamplingParams  # noqa: E402
from radixserve.sched.scheduler import Scheduler  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

POOL = 160  # device slots: two 70-token prompts push the first one out
rng = random.Random(11)
SHARED = [rng.randrange(4, 300) for _ in range(64)]
FIRST = SHARED + [rng.randrange(4, 300) for _ in range(6)]
OTHERS = [[rng.randrange(4, 300) for _ in range(70)] for _ in range(2)]
LATER = SHARED + [rng.randrange(4, 300) for _ in range(5)]
NEW = 6


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def model_dir(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp("tiny-hicache"))


def greedy(rid: str, prompt: list[int]) -> Req:
    sp = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True, return_logprob=True)
    return Req(rid, list(prompt), sp)


def run_one(s: Scheduler, runner: TorchRunner, host: HostKVPool | None, req: Req) -> list:
    """Serve ``req`` alone to completion; returns its sampled tokens' logprobs."""
    s.add_request(req)
    lps = []
    while (batch := s.step()) is not None:
        if host is not None:
            host.apply(batch.kv_copies)
        else:
            assert not batch.kv_copies
        result = runner.run(batch)
        lps += [lp.sampled[1] for lp in result.logprobs.values() if lp.sampled]
        s.on_output(batch, result)
        s.check_integrity()
    return lps


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page", [1, 16])
def test_prefix_loaded_from_host_equals_recomputed(model_dir, policy: str, page: int) -> None:
    runner = TorchRunner(ModelConfig(model=str(model_dir)), num_slots=POOL)
    cache = CacheConfig(page_size=page, max_total_tokens=POOL, enable_hierarchical_cache=True,
                        hicache_write_policy=policy)  # fmt: skip
    s = Scheduler(SchedulerConfig(), cache, host_tokens=cache.host_tokens(None))
    host = HostKVPool(runner.kv, s.kv.host.total)
    run_one(s, runner, host, greedy("first", FIRST))
    for i, prompt in enumerate(OTHERS):
        run_one(s, runner, host, greedy(f"other{i}", prompt))
    assert s.cache.match_prefix(LATER).length < len(SHARED), "the prefix should have left"
    later = greedy("later", LATER)
    got_lps = run_one(s, runner, host, later)
    assert later.host_cached_tokens >= len(SHARED) - len(SHARED) % page - page
    assert later.cached_tokens >= later.host_cached_tokens > 0
    assert host.bytes_loaded > 0

    fresh = Scheduler(SchedulerConfig(), CacheConfig(max_total_tokens=POOL, page_size=page))
    again = greedy("again", LATER)
    want_lps = run_one(fresh, runner, None, again)
    assert again.cached_tokens == 0
    assert later.output_ids == again.output_ids
    assert got_lps == pytest.approx(want_lps, abs=1e-4)


def test_host_bytes_are_the_device_bytes(model_dir) -> None:
    """A store then a load through other slots gives back the same K/V, every layer."""
    import torch

    from radixserve.cache.tiers import PageCopy

    runner = TorchRunner(ModelConfig(model=str(model_dir)), num_slots=32)
    runner.kv.kv.normal_()
    host = HostKVPool(runner.kv, 64)
    before = runner.kv.kv[:, :, 0:8].clone()
    q = "q"
    from array import array

    host.apply([PageCopy("store", array(q, range(8)), array(q, range(40, 48))),
                PageCopy("load", array(q, range(16, 24)), array(q, range(40, 48)))])  # fmt: skip
    assert torch.equal(runner.kv.kv[:, :, 16:24], before)


def test_engine_reports_host_cached_tokens(model_dir) -> None:
    """The real engine processes: /generate's meta_info says where the cached tokens were."""
    from radixserve import Engine

    engine = Engine(model=str(model_dir), max_total_tokens=POOL, context_length=256,
                    enable_hierarchical_cache=True, hicache_ratio=2.0)  # fmt: skip
    try:
        sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True, "return_logprob": True}
        engine.generate(input_ids=FIRST, sampling_params=sp)
        for prompt in OTHERS:
            engine.generate(input_ids=prompt, sampling_params=sp)
        out = engine.generate(input_ids=LATER, sampling_params=sp)
        assert engine.flush_cache()
        again = engine.generate(input_ids=LATER, sampling_params=sp)
    finally:
        engine.shutdown()
    meta = out["meta_info"]
    assert meta["cached_tokens_details"]["host"] >= len(SHARED) - 1
    assert meta["cached_tokens"] == sum(meta["cached_tokens_details"].values())
    assert again["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == again["output_ids"]
    got = [t[0] for t in meta["output_token_logprobs"]]
    want = [t[0] for t in again["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-4)
