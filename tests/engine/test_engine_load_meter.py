"""The load-to-prefill ratios an engine reports: the running means' arithmetic (pure), and a real
engine (two processes on a tiny real-weight model, `--hicache-storage-backend file`) whose host
ratio starts at its start-up measurement and whose store ratio is None until a prefetch has read
pages, after which both are measured values of its own loads."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import pytest

from radixserve.engine.load_meter import LoadRatioMeter, RunningRate


def test_a_rate_is_decided_by_long_steps():
    rate = RunningRate()
    assert rate.per_token() is None
    rate.add(0.013, 2048)  # a long prefill: 6.3 us a token
    for _ in range(5):
        rate.add(0.012, 16)  # short launch-bound ones: 750 us a token
    assert rate.per_token() == pytest.approx(0.013 / 2048, rel=0.05)
    rate.add(1.0, 0)  # nothing timed: ignored
    assert rate.samples == 6


def test_old_samples_fade():
    rate = RunningRate()
    rate.add(1.0, 100)
    for _ in range(60):
        rate.add(0.1, 100)
    assert rate.per_token() == pytest.approx(0.001, rel=0.01)


def test_ratios_say_none_until_measured_and_the_store_adds_the_host_copy():
    meter = LoadRatioMeter()
    assert meter.report()["kv_load_to_prefill_ratio"] is None
    meter = LoadRatioMeter.seeded({"tokens": 1000, "prefill_s": 1.0, "host_load_s": 0.05})
    report = meter.report()
    assert report["kv_load_to_prefill_ratio"] == 0.05
    assert report["kv_store_load_to_prefill_ratio"] is None  # the router charges its default
    assert report["kv_load_timed_host_loads"] == 1 and report["kv_load_timed_store_loads"] == 0
    meter.store_loaded(0.2, 1000)
    assert meter.report()["kv_store_load_to_prefill_ratio"] == 0.25  # 0.2 + 0.05 a token
    with pytest.raises(ValueError, match="decay"):
        LoadRatioMeter(decay=1.0)


# ----- a real engine ------------------------------------------------------------------------

CHUNK = 16
rng = random.Random(7)
SHARED = [rng.randrange(4, 300) for _ in range(100)]
PROMPT = SHARED + [rng.randrange(4, 300) for _ in range(9)]
LOADED = (len(PROMPT) - 1) // CHUNK * CHUNK
SP = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("torch")
    from tiny_models import build_tiny_model

    return build_tiny_model("llama3", tmp_path_factory.mktemp("tiny-meter"))


def engine(model_dir: Path, store: Path):
    from radixserve import Engine

    extra = {"path": str(store), "chunk_size": CHUNK}
    return Engine(model=str(model_dir), max_total_tokens=512, context_length=256,
                  enable_hierarchical_cache=True, hicache_storage_backend="file",
                  hicache_storage_backend_extra_config=json.dumps(extra),
                  hicache_storage_prefetch_policy="wait_complete")  # fmt: skip


def write_prompt(model_dir: Path, store: Path) -> None:
    """Engine A computes PROMPT and writes its pages to ``store``."""
    a = engine(model_dir, store)
    try:
        a.generate(input_ids=PROMPT, sampling_params=SP)
        deadline = time.monotonic() + 30
        while a.stats()["storage_pages_written"] < LOADED // CHUNK:
            assert time.monotonic() < deadline, "A's pages were not written"
            time.sleep(0.05)
    finally:
        a.shutdown()


def test_engine_reports_measured_ratios_after_host_and_store_loads(model_dir, tmp_path):
    store = tmp_path / "kv"
    write_prompt(model_dir, store)
    b = engine(model_dir, store)
    try:
        before = b.stats()
        got = b.generate(input_ids=PROMPT, sampling_params=SP)
        after = b.stats()
        startup = b.procs.info["kv_load_to_prefill_ratio"]
    finally:
        b.shutdown()
    # before any load: the start-up measurement for the host tier, nothing for the store
    assert before["kv_load_to_prefill_ratio"] == startup > 0
    assert before["kv_store_load_to_prefill_ratio"] is None
    assert before["kv_load_timed_host_loads"] == 1 and before["kv_load_timed_store_loads"] == 0
    # the request's prefix came from the store, through the host tier to the device
    assert got["meta_info"]["cached_tokens_details"]["storage"] == LOADED
    assert after["kv_load_timed_store_loads"] == 1
    assert after["kv_load_timed_host_loads"] >= 2 and after["kv_load_timed_prefills"] >= 2
    host, store_ratio = after["kv_load_to_prefill_ratio"], after["kv_store_load_to_prefill_ratio"]
    assert math.isfinite(host) and host > 0 and math.isfinite(store_ratio)
    assert store_ratio >= host  # a store load is a read into the host tier plus a host load
