"""A decode step's layers in one call of the CPU kernels (``csrc/decode_layers.cpp``): the same
logits and the same K/V in the pool as the op-by-op forward, for batches of mixed contexts on
scattered slots, more rows than one register tile takes, one thread and two; the models and steps
it does not take go op by op."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from tiny_models import SlotAllocator, build_tiny_model, entry, torch_threads  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {k: build_tiny_model(k, root) for k in ("llama3", "qwen2", "qwen3", "qwen3_moe")}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One weights cache for the module: the kernels are built once."""
    return tmp_path_factory.mktemp("cache")


def runner(path, cache) -> TorchRunner:
    return TorchRunner(ModelConfig(model=str(path), weights_cache_dir=str(cache)), num_slots=2048)


def mixed_steps(
    r: TorchRunner, rows: int, one_call: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``rows`` requests of different prompt lengths (3 .. 60 tokens) on shuffled slots,
    prefilled together, then 4 decode steps of all of them; each step's logits and the pool."""
    keep = r.model.decode_layers
    alloc = SlotAllocator(2048, seed=rows)
    prompts = [[(7 * i + 13 * j) % 300 + 4 for j in range(3 + (17 * i) % 58)] for i in range(rows)]
    slots = [alloc.take(len(p)) for p in prompts]
    r.logits(Batch([entry(str(i), p, 0, s) for i, (p, s) in enumerate(zip(prompts, slots))]))
    out = []
    r.model.decode_layers = keep if one_call else None
    try:
        for step in range(1, 5):
            entries = []
            for i, p in enumerate(prompts):
                p.append((31 * step + 7 * i) % 300 + 4)  # fixed tokens: no argmax near-ties
                slots[i] = slots[i] + alloc.take(1)
                entries.append(entry(str(i), p[-1:], len(p) - 1, slots[i], num_generated=step))
            out.append(r.logits(Batch(entries)).clone())
    finally:
        r.model.decode_layers = keep
    return out, r.kv.kv.clone()


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
@pytest.mark.parametrize("rows", [1, 3, 11])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_matches_the_op_by_op_forward(models, cache, kind, rows, threads):
    """Logits and every K/V written agree with the op-by-op forward (qwen2: q/k/v biases;
    11 rows: a tile of 8 and one of 3 per weight block)."""
    r = runner(models[kind], cache)
    assert r.model.decode_layers is not None
    with torch_threads(threads):
        ref, ref_kv = mixed_steps(r, rows, one_call=False)
        r.kv.kv.zero_()
        ours, our_kv = mixed_steps(r, rows, one_call=True)
    assert ref[0].std() > 0.1
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"step {step}")
    torch.testing.assert_close(our_kv, ref_kv, atol=1e-5, rtol=1e-5)


def test_the_one_call_is_taken_for_decode_steps_only(models, cache, monkeypatch):
    """A prefill, or a step mixing a prefill with decodes, goes op by op; a decode-only step
    goes through the one call."""
    r = runner(models["llama3"], cache)
    calls = []
    layers = r.model.decode_layers
    monkeypatch.setattr(r.model, "decode_layers", layers)
    orig = type(layers).__call__
    monkeypatch.setattr(type(layers), "__call__", lambda s, *a: calls.append(1) or orig(s, *a))
    r.logits(Batch([entry("a", [5, 6, 7], 0, [0, 1, 2])]))
    assert calls == []
    r.logits(Batch([entry("a", [8], 3, [0, 1, 2, 3], num_generated=1),
                    entry("b", [9, 10], 0, [4, 5])]))  # fmt: skip
    assert calls == []
    r.logits(Batch([entry("a", [11], 4, [0, 1, 2, 3, 6], num_generated=2)]))
    assert calls == [1]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_models_it_does_not_take_go_op_by_op(models, cache, kind):
    """Qwen3's per-head q/k norms and routed experts are not in the one call."""
    assert runner(models[kind], cache).model.decode_layers is None


def test_pytorch_paths_have_no_one_call(models, cache):
    cfg = ModelConfig(model=str(models["llama3"]), weights_cache_dir=str(cache),
                      cpu_kernels="off")  # fmt: skip
    assert TorchRunner(cfg, num_slots=64).model.decode_layers is None


@pytest.mark.parametrize("width", [1, 7, 8, 19, 49152])
def test_argmax_answers_as_torch_does(kernel, width):
    """Random rows, rows of ties (the first wins), a NaN (the first NaN wins), -inf rows, a row
    slice of a wider tensor: the greedy choice equals ``torch.argmax``."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(6, width + 5, generator=g)[:, :width]
    x[1] = 3.0
    x[2] = float("-inf")
    if width > 3:
        x[3, width // 2] = x[3, width - 1] = 100.0
        x[4, 2] = x[4, width - 1] = float("nan")
    torch.testing.assert_close(kernel.argmax(x), x.argmax(dim=-1))


def test_the_sampler_takes_the_kernels_argmax_for_greedy_rows(kernel):
    from radixserve.model.sampler import Sampler
    from radixserve.sched.request import SamplingParams

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    calls = []
    sampler = Sampler(0, lambda x: calls.append(x) or kernel.argmax(x))
    ids = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 3, [0, 0, 0])
    assert ids == logits.argmax(dim=-1).tolist() and len(calls) == 1
