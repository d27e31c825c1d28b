"""Scheduler behaviour a user would notice: right outputs, clear errors, abort, finish, flush."""

from __future__ import annotations

import random

import pytest

from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.batch import StepResult
from radixserve.sched.request import FinishReason, Req, ReqState
from radixserve.sched.scheduler import Scheduler
from test_sched_support import Clock, KVRunner, drive, make_req, reference, tokens


def make(pool: int = 4096, page: int = 1, clock: Clock | None = None, **kw: object) -> Scheduler:
    cfg = SchedulerConfig(**kw)  # type: ignore[arg-type]
    cache = CacheConfig(max_total_tokens=pool, page_size=page)
    return Scheduler(cfg, cache, eos_token_ids=(7,), context_length=4096, clock=clock or Clock())


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("chunk", [-1, 48])
@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_outputs_equal_reference(page: int, chunk: int, policy: str) -> None:
    rng = random.Random(page * 100 + chunk)
    shared = tokens(rng, 120)
    reqs = [
        make_req(f"r{i}", shared + tokens(rng, 5 + i) if i % 2 else tokens(rng, 90), 12)
        for i in range(12)
    ]
    sched = make(
        page=page, chunked_prefill_size=chunk, max_prefill_tokens=200, schedule_policy=policy
    )
    for r in reqs:
        sched.add_request(r)
    outs = drive(sched, KVRunner(4096))
    for r in reqs:
        assert outs[r.rid] == reference(r.input_ids, 12, stop=(7,)), r.rid
        assert r.state is ReqState.FINISHED and r.finish_reason is not None
    assert sched.allocator.available() + sched.cache.evictable_size() == sched.allocator.total


def test_bad_requests_are_refused_with_a_clear_error() -> None:
    sched = make(pool=1000)
    with pytest.raises(ValueError, match="context length"):
        sched.add_request(make_req("long", [1] * 4000, max_new=200))
    with pytest.raises(ValueError, match="KV slots"):
        sched.add_request(make_req("big", [1] * 990, max_new=20))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_req("empty", []))
    sched.add_request(make_req("a", [1, 2, 3]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("a", [1, 2, 3]))
    assert sched.num_waiting == 1


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown schedule policy"):
        make(schedule_policy="nope")
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        make(page=16, chunked_prefill_size=8)


def test_abort_anywhere_frees_everything() -> None:
    rng = random.Random(3)
    sched, runner = make(chunked_prefill_size=32), KVRunner(4096)
    for i, n in enumerate([200, 20, 20]):
        sched.add_request(make_req(f"r{i}", tokens(rng, n), max_new=50))
    batch = sched.step()  # r0 is chunked, r1 and r2 wait or run
    assert batch is not None
    assert sched.abort("r0")  # aborted while its chunk is in flight
    outs = sched.on_output(batch, runner.run(batch))
    assert all(o.rid != "r0" for o in outs)
    sched.check_integrity()
    for rid in ("r1", "r2"):
        assert sched.abort(rid)
        sched.check_integrity()
    assert not sched.abort("r1") and not sched.abort("unknown")
    assert sched.get("r1") is None and sched.num_running == sched.num_waiting == 0
    assert sched.step() is None
    assert sched.flush_cache() and sched.allocator.available() == sched.allocator.total


def test_finish_from_outside_caches_the_request() -> None:
    rng = random.Random(4)
    sched, runner = make(), KVRunner(4096)
    req = make_req("r", tokens(rng, 40), max_new=30)
    sched.add_request(req)
    for _ in range(5):
        batch = sched.step()
        assert batch is not None
        sched.on_output(batch, runner.run(batch))
    assert sched.finish("r", FinishReason.STOP)
    assert req.state is ReqState.FINISHED and req.finish_reason is FinishReason.STOP
    sched.check_integrity()
    cached = [*req.input_ids, *req.output_ids[:-1]]
    assert sched.cache.match_prefix(cached).length == len(cached)  # cached whole


def test_flush_cache_only_when_idle() -> None:
    sched, runner = make(), KVRunner(4096)
    sched.add_request(make_req("r", list(range(1, 30)), max_new=3))
    assert not sched.flush_cache()
    drive(sched, runner)
    assert sched.cache.total_size() > 0
    assert sched.flush_cache()
    assert sched.cache.total_size() == 0
    assert sched.allocator.available() == sched.allocator.total


def test_step_and_on_output_must_alternate() -> None:
    sched, runner = make(), KVRunner(4096)
    sched.add_request(make_req("r", [1, 2, 3]))
    batch = sched.step()
    assert batch is not None
    with pytest.raises(RuntimeError, match="on_output"):
        sched.step()
    with pytest.raises(ValueError, match="one next token"):
        sched.on_output(batch, StepResult([]))
    sched.on_output(batch, runner.run(batch))
    with pytest.raises(ValueError, match="last step"):
        sched.on_output(batch, runner.run(batch))


def test_stop_tokens_and_ignore_eos() -> None:
    prompt = list(range(10, 40))
    ref = reference(prompt, 40)
    stop = ref[5]
    sched, runner = make(), KVRunner(4096)
    sched.add_request(make_req("stop", prompt, max_new=40, stop_token_ids=(stop,)))
    outs = drive(sched, runner)
    assert outs["stop"] == ref[: ref.index(stop) + 1]
    assert sched.stats().num_finished == 1
    # a prompt whose greedy output reaches EOS (7) early: it ends there, unless ignore_eos
    rng = random.Random(0)
    prompt = next(p for p in (tokens(rng, 20) for _ in range(10_000)) if 7 in reference(p, 20)[:15])
    full = reference(prompt, 20)
    sched.add_request(make_req("eos", prompt, max_new=20))
    sched.add_request(make_req("ignore", prompt, max_new=20, ignore_eos=True))
    outs = drive(sched, runner)
    assert outs["eos"] == full[: full.index(7) + 1]
    assert outs["ignore"] == full and len(full) == 20


def test_chunked_prefill_lets_running_requests_keep_decoding() -> None:
    rng = random.Random(5)
    sched, runner = make(chunked_prefill_size=64), KVRunner(4096)
    short, long = make_req("short", tokens(rng, 10), 40), make_req("long", tokens(rng, 640), 4)
    sched.add_request(short)
    kinds = []
    for step in range(30):
        if step == 2:
            sched.add_request(long)
        batch = sched.step()
        assert batch is not None
        kinds.append("".join("p" if e.is_prefill else "d" for e in batch.entries))
        sched.on_output(batch, runner.run(batch))
        sched.check_integrity()
    # ten 64-token chunks alternate with the short request's decodes; then both decode
    assert kinds[2:22] == ["p", "d"] * 9 + ["p", "dd"]
    assert long.output_ids == reference(long.input_ids, 4)[: len(long.output_ids)]


def start_beside_a_decode(sched: Scheduler, runner: KVRunner, short: Req, long: Req) -> None:
    """Prefill ``short`` (one step, so it decodes from now on), then queue ``long``."""
    sched.add_request(short)
    batch = sched.step()
    assert batch is not None
    sched.on_output(batch, runner.run(batch))
    sched.add_request(long)


def test_mixed_chunk_runs_decodes_beside_the_chunk() -> None:
    rng = random.Random(6)
    sched, runner = make(chunked_prefill_size=64, enable_mixed_chunk=True), KVRunner(4096)
    short, long = make_req("short", tokens(rng, 10), 40), make_req("long", tokens(rng, 300), 4)
    start_beside_a_decode(sched, runner, short, long)
    batch = sched.step()
    assert batch is not None
    assert [e.is_prefill for e in batch.entries] == [True, False]
    assert len(batch.entries[0].token_ids) == 63  # the decode took one token of the budget
    sched.on_output(batch, runner.run(batch))
    drive(sched, runner)
    for r in (short, long):
        assert r.output_ids == reference(r.input_ids, r.sampling.max_new_tokens, stop=(7,))


def test_metrics_hit_rate_and_usage() -> None:
    sched, runner = make(), KVRunner(4096)
    prompt = list(range(100, 300))
    sched.add_request(make_req("a", prompt, 4))
    drive(sched, runner)
    sched.add_request(make_req("b", prompt + [1, 2, 3], 4))
    assert sched.num_waiting == 1 and sched.num_running == 0
    batch = sched.step()
    assert batch is not None and sched.num_running == 1
    assert 0 < sched.stats().kv_usage < 1  # the locked prefix and the new slots
    sched.on_output(batch, runner.run(batch))
    drive(sched, runner)
    st = sched.stats()
    assert st.prompt_tokens == 403 and st.cached_prompt_tokens == 200
    assert st.cache_hit_rate == pytest.approx(200 / 403)
    assert st.kv_usage == 0.0 and st.num_finished == 2 and sched.get("b") is None


def test_timestamps_and_cached_tokens() -> None:
    clock = Clock()
    sched, runner = make(clock=clock), KVRunner(4096)
    prompt = list(range(100, 300))
    first, second = make_req("a", prompt, 4), make_req("b", prompt + [5, 6], 4)
    sched.add_request(first)
    drive(sched, runner, clock)
    clock.t = 10.0
    sched.add_request(second)
    drive(sched, runner, clock)
    assert second.arrival_time == 10.0 and second.first_scheduled_time == 10.0
    assert second.first_token_time is not None and second.finish_time is not None
    assert second.arrival_time <= second.first_token_time <= second.finish_time
    assert first.cached_tokens == 0 and second.cached_tokens == 200


def test_priority_preemption_resumes_exactly() -> None:
    rng = random.Random(8)
    sched = make(
        pool=700,
        enable_priority_scheduling=True,
        priority_preemption_threshold=0,
        max_running_requests=2,
    )
    runner = KVRunner(700)
    low = [make_req(f"low{i}", tokens(rng, 100), 150, priority=0) for i in range(2)]
    high = make_req("high", tokens(rng, 100), 20, priority=5)
    for r in low:
        sched.add_request(r)
    for _ in range(10):
        batch = sched.step()
        assert batch is not None
        sched.on_output(batch, runner.run(batch))
    sched.add_request(high)
    batch = sched.step()
    assert batch is not None and [e.rid for e in batch.entries] == ["high"]
    assert sched.stats().num_retracted == 1
    sched.on_output(batch, runner.run(batch))
    outs = drive(sched, runner)
    assert high.finish_time is not None
    for r in [*low, high]:
        assert r.output_ids == reference(r.input_ids, r.sampling.max_new_tokens)
    assert max(r.num_retractions for r in low) == 1 and len(outs) == 3


def test_stats_count_the_prefill_tokens_still_to_compute() -> None:
    # what a worker reports in /get_loads for a kv_aware router: waiting prompts beyond their
    # cached match, plus what is left of the chunked one; decoding requests count nothing
    rng = random.Random(9)
    sched, runner = make(chunked_prefill_size=64), KVRunner(4096)
    first, second = make_req("a", tokens(rng, 200), 3), make_req("b", tokens(rng, 100), 3)
    sched.add_request(first)
    sched.add_request(second)
    assert sched.stats().waiting_prefill_tokens == 300
    batch = sched.step()  # one 64-token chunk of the first
    sched.on_output(batch, runner.run(batch))
    assert sched.stats().waiting_prefill_tokens == 300 - 64
    while sched.stats().num_waiting or sched.running.chunked is not None:
        batch = sched.step()
        sched.on_output(batch, runner.run(batch))
    assert sched.stats().waiting_prefill_tokens == 0


def test_a_cpu_engine_prefills_in_1024_token_steps_beside_the_running_decodes() -> None:
    """What `serve` on a CPU does by default (EngineConfig resolves the scheduler's settings for
    the model's device): a long prompt arriving while another request decodes is prefilled in
    steps of 1,024 tokens (the decode takes one of them), each carrying the running decode, so
    that request keeps producing tokens meanwhile; on a GPU the same prompt is one 3,000-token
    step and the decode waits."""
    from radixserve.engine.launch import EngineConfig

    cpu = EngineConfig().sched
    gpu = SchedulerConfig().for_device("cuda")
    assert (cpu.max_prefill_tokens, cpu.chunked_prefill_size, cpu.enable_mixed_chunk) == (
        1024, 1024, True
    )  # fmt: skip
    rng = random.Random(8)
    for cfg, want_chunks in ((cpu, [1023, 1023, 954]), (gpu, [3000])):
        sched = Scheduler(cfg, CacheConfig(max_total_tokens=8192), eos_token_ids=(7,),
                          context_length=8192, clock=Clock())  # fmt: skip
        runner = KVRunner(8192)
        short, long = make_req("short", tokens(rng, 10), 40), make_req("long", tokens(rng, 3000), 2)
        start_beside_a_decode(sched, runner, short, long)
        chunks, decoded = [], 0
        while long.first_token_time is None:
            batch = sched.step()
            assert batch is not None
            for e in batch.entries:
                if e.rid == "long":
                    chunks.append(len(e.token_ids))
                else:
                    decoded += 1
            sched.on_output(batch, runner.run(batch))
        assert chunks == want_chunks
        # the running request decoded in every step of the prefill on a CPU, in none on a GPU
        assert decoded == (len(want_chunks) if cfg is cpu else 0)
        drive(sched, runner)
        for r in (short, long):
            assert r.output_ids == reference(r.input_ids, r.sampling.max_new_tokens, stop=(7,))


def test_device_defaults_fill_only_what_was_not_set() -> None:
    cfg = SchedulerConfig(max_prefill_tokens=4096, enable_mixed_chunk=False)
    cpu, gpu = cfg.for_device("cpu"), cfg.for_device("cuda")
    assert (cpu.max_prefill_tokens, cpu.chunked_prefill_size, cpu.enable_mixed_chunk) == (
        4096, 1024, False
    )  # fmt: skip
    assert (gpu.max_prefill_tokens, gpu.chunked_prefill_size, gpu.enable_mixed_chunk) == (
        4096, 8192, False
    )  # fmt: skip
    assert SchedulerConfig().for_device("cuda").max_prefill_tokens == 16384
