"""The torch runner on CUDA computes what it computes on the CPU (skipped without a GPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from tiny_models import SlotAllocator, build_tiny_model, greedy_generate  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PROMPTS = [[0, 40, 41, 42, 43], [0, 40, 41, 90], [0, 7]]


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "qwen3_moe"])
def test_cuda_greedy_equals_cpu(kind, tmp_path):
    path = build_tiny_model(kind, tmp_path)
    outs = []
    for device in ("cpu", "cuda"):
        runner = TorchRunner(ModelConfig(model=str(path), device=device), num_slots=256)
        outs.append(greedy_generate(runner, PROMPTS, 8, SlotAllocator(256, seed=1), chunk=3))
    assert outs[0] == outs[1]


def test_cuda_bfloat16_runs(tmp_path):
    path = build_tiny_model("qwen2", tmp_path)
    config = ModelConfig(model=str(path), device="cuda", dtype="bfloat16")
    runner = TorchRunner(config, num_slots=64)
    outs = greedy_generate(runner, PROMPTS, 4, SlotAllocator(64))
    assert all(len(o) == 4 for o in outs)
