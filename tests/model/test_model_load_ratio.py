"""The load-to-prefill ratio an engine measures at start-up and reports in /get_server_info
(issue 28 item 2): a real prefill and a real host -> device copy on a tiny real-weight model;
measured where the engine has a host tier, absent where it has nothing to load from."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from radixserve.config import CacheConfig, ModelConfig  # noqa: E402
from radixserve.engine.launch import EngineConfig  # noqa: E402
from radixserve.model.load_ratio import measure_load_ratio  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sim.runner import SimRunner  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama3", tmp_path_factory.mktemp("tiny-ratio"))


def test_ratio_is_measured_and_leaves_the_pool_as_the_allocator_left_it(model_dir):
    runner = TorchRunner(ModelConfig(model=str(model_dir)), num_slots=300)
    ratio = measure_load_ratio(runner, tokens=64)
    assert ratio is not None and math.isfinite(ratio) and ratio > 0
    assert float(runner.kv.kv.abs().sum()) == 0.0  # no K/V left behind in slots 0..63
    # a pool smaller than the sample is measured at its size; a simulated runner has no bytes
    assert measure_load_ratio(TorchRunner(ModelConfig(model=str(model_dir)), 8), 64) > 0
    assert measure_load_ratio(SimRunner()) is None


def test_engine_reports_the_ratio_only_with_a_host_tier(model_dir):
    model = ModelConfig(model=str(model_dir))
    tiered = CacheConfig(max_total_tokens=256, enable_hierarchical_cache=True)
    *_, info = EngineConfig(model=model, cache=tiered).build_worker()
    assert info["kv_load_to_prefill_ratio"] > 0
    *_, info = EngineConfig(model=model, cache=CacheConfig(max_total_tokens=256)).build_worker()
    assert info["kv_load_to_prefill_ratio"] is None
