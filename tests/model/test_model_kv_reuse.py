"""Prefix reuse, batching, chunking and slot layout change nothing the model computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.kv_pool import KVPool  # noqa: E402
from radixserve.model.runner import TorchRunner, kv_bytes_per_token  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from tiny_models import SlotAllocator, build_tiny_model, entry, greedy_generate  # noqa: E402

SHARED = [0, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]
PROMPTS = [SHARED + [60, 61, 62], SHARED + [70], SHARED[:5] + [80, 81, 82, 83, 84, 85], [0, 9]]
STEPS = 8


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3", "qwen3_moe"])
def runner(request, tmp_path_factory):
    path = build_tiny_model(request.param, tmp_path_factory.mktemp("tiny"))
    return TorchRunner(ModelConfig(model=str(path)), num_slots=512)


@pytest.fixture(scope="module")
def reference(runner):
    """Each prompt alone, computed whole, on contiguous slots."""
    outs = []
    for prompt in PROMPTS:
        alloc = SlotAllocator(512, seed=0)
        alloc.free.sort()
        outs.append(greedy_generate(runner, [prompt], STEPS, alloc)[0])
    return outs


def test_batched_with_shuffled_slots_equals_alone(runner, reference):
    assert greedy_generate(runner, PROMPTS, STEPS, SlotAllocator(512, seed=1)) == reference


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunked_prefill_equals_whole(runner, reference, chunk):
    outs = greedy_generate(runner, PROMPTS, STEPS, SlotAllocator(512, seed=chunk), chunk=chunk)
    assert outs == reference


def test_cached_prefix_equals_computed_whole(runner, reference):
    alloc = SlotAllocator(512, seed=7)
    prefix_slots = alloc.take(len(SHARED))
    # an earlier request computes the shared prefix; its slots stay in the pool (the radix tree)
    runner.run(Batch([entry("warm", SHARED, 0, prefix_slots, sample=False)]))
    cached = []
    for prompt in PROMPTS:
        n = _common_prefix(prompt, SHARED)
        n = min(n, len(prompt) - 1)  # the last prompt token is always recomputed
        cached.append((prompt[:n], prefix_slots[:n]))
    assert greedy_generate(runner, PROMPTS, STEPS, alloc, cached=cached) == reference


def test_prefill_joining_running_decodes_equals_alone(runner, reference):
    """Continuous batching: a prefill listed first shares a step with a running decode."""
    alloc = SlotAllocator(512, seed=3)
    a, b = PROMPTS[0], PROMPTS[2]
    a_slots, b_slots = alloc.take(len(a)), alloc.take(len(b))
    out_a = runner.run(Batch([entry("a", a, 0, a_slots)])).next_token_ids
    out_b: list[int] = []
    for step in range(1, 4):
        a_slots += alloc.take(1)
        decode_a = entry("a", out_a[-1:], len(a) + step - 1, a_slots, num_generated=step)
        if step == 1:
            other = entry("b", b, 0, b_slots)
        else:
            b_slots += alloc.take(1)
            other = entry("b", out_b[-1:], len(b) + step - 2, b_slots, num_generated=step - 1)
        tok_b, tok_a = runner.run(Batch([other, decode_a])).next_token_ids
        out_a.append(tok_a)
        out_b.append(tok_b)
    assert out_a == reference[0][:4]
    assert out_b == reference[2][:3]


def test_non_sampling_entries_get_none(runner):
    alloc = SlotAllocator(512, seed=4)
    batch = Batch([entry("a", [0, 5, 6], 0, alloc.take(3), sample=False)])
    assert runner.run(batch).next_token_ids == [None]


def test_bad_slots_are_rejected(runner):
    with pytest.raises(ValueError, match="slots"):
        runner.run(Batch([entry("a", [0, 5, 6], 0, [1, 2])]))
    with pytest.raises(ValueError, match="slot id"):
        runner.run(Batch([entry("a", [0, 5], 0, [1, 10_000])]))


def test_kv_bytes_per_token_matches_the_pool(runner):
    per_token = kv_bytes_per_token(runner.config)
    head_dim = runner.arch.head_dim  # 16 (hidden / heads) or 24 (Qwen3's own head_dim)
    assert head_dim == (24 if "qwen3" in str(runner.config.model) else 16)
    assert per_token == 2 * 2 * 2 * head_dim * 4  # layers, K and V, kv heads, head dim, float32
    assert runner.kv.nbytes == per_token * runner.kv.num_slots


def test_kv_pool_write_then_gather_by_slot():
    pool = KVPool(2, 16, 2, 4, torch.float32, "cpu")
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    pool.write(1, torch.tensor([9, 2, 14]), k, v)
    gk, gv = pool.gather(1, torch.tensor([[14, 9], [2, 2]]))
    assert gk.shape == (2, 2, 2, 4)
    torch.testing.assert_close(gk[0, 0], k[2])
    torch.testing.assert_close(gv[1, 1], v[1])
    assert pool.gather(0, torch.tensor([9]))[0].abs().sum() == 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
