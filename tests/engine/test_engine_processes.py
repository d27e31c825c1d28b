"""The engine as users run it: three processes over ZeroMQ behind ``Engine`` (tiny model)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytest.importorskip("torch")

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.engine.procutil import OMP_WAIT_VARS, omp_wait_settings  # noqa: E402
from radixserve.engine.tokenizer_manager import EngineDeadError, RequestError  # noqa: E402
from server_harness import alive, wait_gone  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [
    "the quick brown fox jumps over the lazy dog and",
    "the quick brown fox jumps over the lazy dog but",
    "a radix tree shares the prefixes",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama3", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = Engine(model=str(model_dir), max_total_tokens=2048, context_length=128)
    yield eng
    eng.shutdown()


def wait_idle(engine: Engine, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        st = engine.stats()
        if st["num_running"] == 0 and st["num_waiting"] == 0:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.05)


def test_batched_equals_alone_and_repeats_hit_the_cache(engine):
    alone = [engine.generate(p, GREEDY) for p in PROMPTS]
    batched = engine.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in batched] == [o["output_ids"] for o in alone]
    assert [o["text"] for o in batched] == [o["text"] for o in alone]
    for o in batched:
        meta = o["meta_info"]
        assert meta["completion_tokens"] == 12 and meta["finish_reason"] == "length"
        assert meta["cached_tokens"] > 0  # the same prompts ran alone just before
        assert len(engine.tokenizer.encode(o["text"], add_special_tokens=False)) > 0


def test_a_stream_grows_to_the_whole_as_sglang_engines_do(engine):
    """async_generate(stream=True) and generate(stream=True) take sglang.Engine's `stream` and
    yield the whole result so far; awaited without it, async_generate is the result."""
    whole = engine.generate(PROMPTS[2], GREEDY)

    async def stream():
        return [c async for c in await engine.async_generate(PROMPTS[2], GREEDY, stream=True)]

    for chunks in (asyncio.run(stream()), list(engine.generate(PROMPTS[2], GREEDY, stream=True))):
        assert len(chunks) == 12
        assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))
        assert all(whole["text"].startswith(c["text"]) for c in chunks)
        assert chunks[-1]["text"] == whole["text"]
        assert chunks[-1]["output_ids"] == whole["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == "length"
        assert chunks[0]["meta_info"]["finish_reason"] is None
    awaited = asyncio.run(engine.async_generate(PROMPTS[2], GREEDY))
    assert awaited["output_ids"] == whole["output_ids"] and awaited["text"] == whole["text"]
    both = asyncio.run(engine.async_generate(PROMPTS[:2], GREEDY))
    assert [o["output_ids"] for o in both] == [
        o["output_ids"] for o in engine.generate(PROMPTS[:2], GREEDY)
    ]
    with pytest.raises(ValueError, match="stream=True takes one prompt"):
        engine.generate(PROMPTS[:2], GREEDY, stream=True)


def test_a_negative_max_new_tokens_names_the_real_bound(engine):
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 0 \(0: prefill"):
        engine.generate(PROMPTS[0], {"max_new_tokens": -1})
    assert engine.generate(PROMPTS[0], {"max_new_tokens": 0})["output_ids"] == []


def test_stop_string_ends_the_text_before_it(engine):
    whole = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 24})["text"]
    stop = whole[5:8]
    assert stop.strip(), whole
    out = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 24, "stop": stop})
    assert out["text"] == whole[: whole.index(stop)]
    assert out["meta_info"]["finish_reason"] == "stop"
    assert out["meta_info"]["matched_stop"] == stop


def test_a_consumer_that_leaves_early_frees_its_kv(engine):
    async def leave_after_two():
        n = 0
        sp = {**GREEDY, "max_new_tokens": 80}
        async for _ in await engine.async_generate(PROMPTS[1], sp, stream=True):
            n += 1
            if n == 2:
                break

    asyncio.run(leave_after_two())
    st = wait_idle(engine)
    assert st["num_aborted"] >= 1
    assert st["kv_usage"] == 0.0  # nothing held: every slot is free or evictable cache


def test_bad_requests_get_clear_errors_and_the_engine_goes_on(engine):
    with pytest.raises(RequestError, match="context length"):
        engine.generate("fox " * 200, GREEDY)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(PROMPTS[0], {"max_new_tokens": -1})
    warm = engine.generate(PROMPTS[0], {"max_new_tokens": 0})  # prefill only, as SGLang's
    assert warm["text"] == "" and warm["meta_info"]["completion_tokens"] == 0
    with pytest.raises(RequestError, match="token ids"):
        engine.generate(input_ids=[1, 2, 10**6], sampling_params=GREEDY)
    assert engine.generate(PROMPTS[0], GREEDY)["meta_info"]["completion_tokens"] == 12


def test_scheduler_settings_change_while_the_engine_runs(engine):
    """README's `engine.update_scheduler_settings(...)`: the scheduler process takes the new
    settings, refuses what cannot change (changing nothing) and goes on serving."""
    got = engine.update_scheduler_settings(schedule_policy="fcfs", max_wait_ms=500)
    assert (got["schedule_policy"], got["max_wait_ms"]) == ("fcfs", 500)
    with pytest.raises(ValueError, match="cannot change page_size"):
        engine.update_scheduler_settings(page_size=4, schedule_policy="lof")
    assert engine.update_scheduler_settings()["schedule_policy"] == "fcfs"  # no change: reads
    restored = engine.update_scheduler_settings(schedule_policy="lpm", max_wait_ms=1000.0)
    assert (restored["schedule_policy"], restored["max_wait_ms"]) == ("lpm", 1000.0)
    assert engine.generate(PROMPTS[0], GREEDY)["meta_info"]["completion_tokens"] == 12


def test_dead_scheduler_fails_callers_and_shutdown_leaves_no_process(model_dir):
    eng = Engine(model=str(model_dir), max_total_tokens=1024)
    pids = [p.pid for p in eng.procs.procs]
    assert all(alive(p) for p in pids)
    sched = next(p for p in eng.procs.procs if "scheduler" in p.name)

    async def long_request():
        sp = {**GREEDY, "max_new_tokens": 80}
        return [c async for c in await eng.async_generate(PROMPTS[0], sp, stream=True)]

    started = time.monotonic()
    os.kill(sched.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        asyncio.run(long_request())
    with pytest.raises(EngineDeadError):
        eng.generate(PROMPTS[0], GREEDY)
    assert time.monotonic() - started < 10  # an error, not a hang
    eng.shutdown()
    assert wait_gone(pids, 10) == []


def test_shutdown_of_a_healthy_engine_leaves_no_process(model_dir):
    with Engine(model=str(model_dir), max_total_tokens=1024) as eng:
        pids = [p.pid for p in eng.procs.procs]
        eng.generate(PROMPTS[0], GREEDY)
    assert wait_gone(pids, 10) == []


def test_a_model_without_the_engine_extra_says_how_to_install_it(monkeypatch):
    import importlib.util

    from radixserve.engine.launch import EngineConfig, EngineStartError, launch

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    with pytest.raises(EngineStartError, match=r"pip install torch==2\.13\.0 .*--sim"):
        launch(EngineConfig())


def test_the_model_process_runs_with_the_users_openmp_wait_settings(model_dir, monkeypatch):
    """The engine leaves OpenMP's wait policy to the user (libgomp's spinning default when none
    is set) and says in its info what the model process runs with."""
    for var in OMP_WAIT_VARS:
        monkeypatch.delenv(var, raising=False)
    with Engine(model=str(model_dir), max_total_tokens=1024) as eng:
        assert eng.procs.info["omp"] == {}
        assert eng.procs.info["num_threads"] == 1  # OMP_NUM_THREADS=1 (tests/conftest.py)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # cores shared with other jobs
    with Engine(model=str(model_dir), max_total_tokens=1024) as eng:
        assert eng.procs.info["omp"] == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_the_wait_settings_are_read_never_changed():
    env = {"GOMP_SPINCOUNT": "10000"}
    out = omp_wait_settings(env)  # torch is loaded in this process: said
    assert env == {"GOMP_SPINCOUNT": "10000"} and out["GOMP_SPINCOUNT"] == "10000"
    assert "torch was imported" in out["note"]
    assert omp_wait_settings({}) == {"note": out["note"]}
