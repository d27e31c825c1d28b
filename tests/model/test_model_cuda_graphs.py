"""Decode CUDA graphs: the buckets, and the padded static-buffer step they capture, checked on
the CPU without a graph (``capture=False``) against the runner's own step; graph replay itself
is checked where a GPU is lent (``-m gpu``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.cuda_graphs import DecodeGraphs, batch_buckets, width_bucket  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from tiny_models import GREEDY, SlotAllocator, build_tiny_model, entry, greedy_generate  # noqa: E402

SLOTS = 256
PROMPTS = [[0, 40, 41, 42, 43, 44, 45], [0, 40, 41, 90], [0, 7], [0, 9, 9, 9, 9, 9, 9, 9, 9]]


def test_batch_buckets_follow_sglang_and_end_at_the_max():
    assert batch_buckets(256)[:8] == [1, 2, 4, 8, 12, 16, 24, 32]
    assert batch_buckets(256)[-1] == 256 and len(batch_buckets(256)) == 36
    assert batch_buckets(20) == [1, 2, 4, 8, 12, 16, 20]
    assert batch_buckets(1) == [1]


def test_width_bucket_pads_at_most_an_eighth_and_never_past_the_cap():
    assert width_bucket(1, 8192) == 64 and width_bucket(64, 8192) == 64
    assert width_bucket(65, 8192) == 128 and width_bucket(1000, 8192) == 1024
    assert width_bucket(4097, 8192) == 4608
    for n in range(257, 8192, 97):
        w = width_bucket(n, 8192)
        assert 0 <= w - n < max(64, n / 8)
    assert width_bucket(8000, 8100) == 8100
    assert width_bucket(8193, 8192) is None


def runner_with_graphs(path, backend="torch-gather", max_bs=8):
    """A CPU runner whose KV pool has a scratch slot and whose decodes take the graphs' padded
    path, run without capture."""
    config = ModelConfig(model=str(path), attention_backend=backend)
    runner = TorchRunner(config, num_slots=SLOTS)
    runner.kv = runner.model.new_kv_pool(SLOTS, scratch=True)
    runner.backend.bind(runner.kv)
    runner.graphs = DecodeGraphs(runner.model, runner.kv, max_bs, 256, capture=False)
    return runner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model("llama3", tmp_path_factory.mktemp("graphs"))


def test_padded_decode_path_generates_what_the_runner_does(tiny):
    """Four requests of different lengths (padded to bucket 4, widths 64) and three (padded
    from 3 to 4): the same greedy tokens as the runner's own decode path."""
    plain = TorchRunner(ModelConfig(model=str(tiny)), num_slots=SLOTS)
    want = greedy_generate(plain, PROMPTS, 10, SlotAllocator(SLOTS, seed=3))
    got = greedy_generate(runner_with_graphs(tiny), PROMPTS, 10, SlotAllocator(SLOTS, seed=3))
    assert got == want
    three = greedy_generate(runner_with_graphs(tiny), PROMPTS[:3], 6, SlotAllocator(SLOTS))
    assert three == greedy_generate(plain, PROMPTS[:3], 6, SlotAllocator(SLOTS))


def test_padded_decode_logits_match_and_padding_touches_only_the_scratch_slot(tiny):
    runner = runner_with_graphs(tiny)
    alloc = SlotAllocator(SLOTS, seed=5)
    slots = [alloc.take(len(p) + 1) for p in PROMPTS[:3]]
    runner.logits(
        Batch([entry(str(i), p, 0, s[:-1]) for i, (p, s) in enumerate(zip(PROMPTS, slots))])
    )
    decodes = [
        entry(str(i), [5], len(p), s, True, GREEDY, 1)
        for i, (p, s) in enumerate(zip(PROMPTS, slots))
    ]
    before = runner.kv.kv.clone()
    assert runner.graphs.accepts(decodes)
    got = runner.graphs.logits(decodes).clone()
    written = {s[-1] for s in slots}
    changed = (runner.kv.kv != before).flatten(3).any(-1).any(0).any(0).nonzero().flatten()
    assert set(changed.tolist()) <= written | {SLOTS}
    assert set(changed.tolist()) >= written
    runner.kv.kv.copy_(before)
    runner.graphs = None
    want = runner.logits(Batch(decodes))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_graphs_leave_what_they_cannot_run_to_the_eager_path(tiny):
    runner = runner_with_graphs(tiny, max_bs=2)
    d = [entry(str(i), [5], 4, list(range(i * 8, i * 8 + 5)), True, GREEDY, 1) for i in range(3)]
    graphs = runner.graphs
    assert graphs.accepts(d[:2])
    assert not graphs.accepts(d)  # more than the largest bucket
    assert not graphs.accepts([entry("p", [1, 2], 0, [0, 1])])  # a prefill
    assert not graphs.accepts([entry("n", [5], 4, list(range(5)), sample=False)])
    assert not graphs.accepts([entry("w", [5], 300, list(range(301)), True, GREEDY, 1)])


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_cuda_graph_replay_generates_what_kernel_by_kernel_does(tiny, tmp_path, kind, n):
    """Replayed graphs (padded from 3 rows to 4, and exactly 4) give the eager path's greedy
    tokens in float32, and graphs were really captured (Qwen3's q/k norms inside them too)."""
    path = tiny if kind == "llama3" else build_tiny_model(kind, tmp_path)
    outs = []
    for off in (True, False):
        config = ModelConfig(model=str(path), device="cuda", disable_cuda_graph=off)
        runner = TorchRunner(config, num_slots=SLOTS)
        assert (runner.graphs is None) == off
        outs.append(greedy_generate(runner, PROMPTS[:n], 12, SlotAllocator(SLOTS, seed=2)))
    assert outs[0] == outs[1]
    assert runner.graphs.graphs and all(g.graph is not None for g in runner.graphs.graphs.values())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_cuda_graph_logits_match_eager(tiny, dtype, tol):
    """One decode step of four rows of different lengths: ||graph - eager|| / ||eager||."""
    logits = []
    for off in (True, False):
        config = ModelConfig(model=str(tiny), device="cuda", dtype=dtype, disable_cuda_graph=off)
        runner = TorchRunner(config, num_slots=SLOTS)
        alloc = SlotAllocator(SLOTS, seed=7)
        slots = [alloc.take(len(p) + 1) for p in PROMPTS]
        runner.logits(
            Batch([entry(str(i), p, 0, s[:-1]) for i, (p, s) in enumerate(zip(PROMPTS, slots))])
        )
        decodes = [
            entry(str(i), [5], len(p), s, True, GREEDY, 1)
            for i, (p, s) in enumerate(zip(PROMPTS, slots))
        ]
        logits.append(runner.logits(Batch(decodes)).double().cpu())
    rel = float((logits[1] - logits[0]).norm() / logits[0].norm())
    assert rel < tol
