"""The cost model's step times behave as a user of a real engine would expect them to."""

from __future__ import annotations

import pytest

from radixserve.sim.costmodel import (
    A100_SXM_80GB,
    COST_MODELS,
    LLAMA3_70B,
    CostModel,
    StepEntry,
    get_cost_model,
)

REAL = ["llama3-8b-h100", "llama3-8b-a100", "llama3-70b-tp4-h100", "llama3-70b-tp4-a100"]


def decode_batch(n: int, context: int) -> list[StepEntry]:
    return [StepEntry(1, context, False)] * n


def test_registry_has_the_presets_and_names_them_on_error() -> None:
    assert set(REAL) | {"tiny-cpu"} <= set(COST_MODELS)
    with pytest.raises(ValueError, match="llama3-8b-h100"):
        get_cost_model("llama3-8b-h200")


@pytest.mark.parametrize("name", REAL)
def test_cached_prefill_is_far_cheaper_than_uncached(name: str) -> None:
    cm = get_cost_model(name)
    uncached = cm.step_time([(2000, 0, True)])
    cached = cm.step_time([(10, 2000, True)])
    assert uncached > 5 * cached


@pytest.mark.parametrize("name", REAL + ["tiny-cpu"])
def test_decode_time_grows_with_the_kv_the_batch_reads(name: str) -> None:
    cm = get_cost_model(name)
    short, long = cm.step_time(decode_batch(32, 500)), cm.step_time(decode_batch(32, 4000))
    assert long > short
    assert cm.step_time(decode_batch(64, 500)) > short


def test_bigger_model_and_older_gpu_are_slower_per_token() -> None:
    step = decode_batch(1, 1000)
    t = {name: get_cost_model(name).step_time(step) for name in REAL}
    assert t["llama3-70b-tp4-h100"] > t["llama3-8b-h100"]
    assert t["llama3-70b-tp4-a100"] > t["llama3-8b-a100"]
    assert t["llama3-8b-a100"] > t["llama3-8b-h100"]


def test_8b_on_h100_is_in_the_range_engines_measure() -> None:
    cm = get_cost_model("llama3-8b-h100")
    assert 0.004 < cm.step_time(decode_batch(1, 1000)) < 0.015  # 70-250 tok/s for one stream
    prefill_tok_s = 8192 / cm.step_time([(8192, 0, True)])
    assert 10_000 < prefill_tok_s < 60_000
    assert 300_000 < cm.kv_capacity_tokens < 600_000


def test_kv_capacity_accounts_for_tensor_parallel_shards() -> None:
    # 70B's weights do not fit one A100 at all; over 4 GPUs each holds a quarter of weights and KV
    with pytest.raises(ValueError, match="no GPU memory"):
        CostModel("70b-one-a100", LLAMA3_70B, A100_SXM_80GB)
    assert get_cost_model("llama3-70b-tp4-a100").kv_capacity_tokens > 100_000


def test_tensor_parallel_pays_for_all_reduce() -> None:
    assert get_cost_model("llama3-70b-tp4-h100").step_cost([(512, 0, True)]).allreduce > 0
    assert get_cost_model("llama3-8b-h100").step_cost([(512, 0, True)]).allreduce == 0


def test_mixed_step_costs_less_than_two_steps_but_more_than_either() -> None:
    cm = get_cost_model("llama3-8b-h100")
    prefill, decode = [StepEntry(1024, 0, True)], decode_batch(32, 2000)
    mixed = cm.step_time(prefill + decode)
    assert max(cm.step_time(prefill), cm.step_time(decode)) < mixed
    assert mixed < cm.step_time(prefill) + cm.step_time(decode)


def test_tiny_preset_is_fast_and_empty_steps_are_free() -> None:
    cm = get_cost_model("tiny-cpu")
    assert cm.step_time(decode_batch(8, 100)) < 1e-3
    assert cm.step_time([]) == 0.0
    assert cm.step_cost([(3, 0, True)]).total == cm.step_time([StepEntry(3, 0, True)])
