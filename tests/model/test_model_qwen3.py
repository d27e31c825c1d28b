"""Qwen3 and Qwen3-MoE beyond the shared parity tests: each expert multiplies only the rows
routed to it, PyTorch's path (CPU kernels off) matches transformers too, and which layers are
sparse follows ``mlp_only_layers`` and ``decoder_sparse_step``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.arch import ModelArch  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from tiny_models import SlotAllocator, build_tiny_model, entry  # noqa: E402

PROMPT = [0, 17, 93, 140, 201, 33, 250, 7, 64, 99, 180, 12]


class Counting:
    """A stand-in layer around a real one that records which rows it was given."""

    def __init__(self, inner, seen: list[torch.Tensor]) -> None:
        self.inner, self.seen = inner, seen

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return self.inner(x)


def test_each_expert_multiplies_only_the_rows_routed_to_it(tmp_path):
    path = build_tiny_model("qwen3_moe", tmp_path)
    runner = TorchRunner(ModelConfig(model=str(path)), num_slots=64)
    block = runner.model.layers[0].moe
    assert block is not None and runner.model.layers[1].moe is None  # mlp_only_layers [1]
    seen: list[list[torch.Tensor]] = [[] for _ in block.experts]
    block.experts = [(Counting(gu, s), d) for (gu, d), s in zip(block.experts, seen)]
    routed: list[torch.Tensor] = []
    block.router = Counting(block.router, routed)  # the rows the router was given
    runner.logits(Batch([entry("a", PROMPT, 0, SlotAllocator(64).take(len(PROMPT)))]))
    h = routed[0]
    _, chosen = block.route(h)
    for e, calls in enumerate(seen):
        rows = (chosen == e).any(dim=1).nonzero().flatten()
        assert len(calls) == (1 if len(rows) else 0)  # one matmul per expert, none if idle
        if len(rows):
            torch.testing.assert_close(calls[0], h[rows], atol=0, rtol=0)
    assert sum(len(c[0]) for c in seen if c) == len(PROMPT) * 2  # T tokens x top 2, not x 8


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_pytorch_path_matches_transformers(tmp_path, kind):
    path = build_tiny_model(kind, tmp_path)
    config = ModelConfig(model=str(path), cpu_kernels="off", attention_backend="cpu-contig")
    runner = TorchRunner(config, num_slots=64)
    assert runner.kernels is None
    ours = runner.logits(Batch([entry("a", PROMPT, 0, SlotAllocator(64).take(len(PROMPT)))]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(ours[0], ref, atol=1e-4, rtol=1e-4)


def test_sparse_layers_follow_the_config():
    base = {"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 6, "num_attention_heads": 2,
            "head_dim": 6, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 4}  # fmt: skip

    def sparse(**cfg) -> list[int]:
        arch = ModelArch.from_hf_config({**base, **cfg})
        return [i for i in range(arch.num_layers) if arch.is_moe_layer(i)]

    assert sparse() == [0, 1, 2, 3, 4, 5]
    assert sparse(decoder_sparse_step=2) == [1, 3, 5]
    assert sparse(decoder_sparse_step=2, mlp_only_layers=[3]) == [1, 5]
    assert ModelArch.from_hf_config({**base, "model_type": "qwen3"}).moe is None
    assert ModelArch.from_hf_config(base).head_dim == 6  # Qwen3's own, not hidden / heads
    with pytest.raises(ValueError, match="num_experts_per_tok 5 not in 1..4"):
        ModelArch.from_hf_config({**base, "num_experts_per_tok": 5})
