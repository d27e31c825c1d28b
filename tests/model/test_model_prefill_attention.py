"""radixserve's prefill attention kernel (``model/csrc/prefill_attention.cpp``): a prompt
chunk's causal attention over its whole context read from the pool by slot computes what
PyTorch's SDPA computes with the offset causal mask, and ``cpu-paged`` runs prefill chunks
through it with the logits of the reference backend."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from tiny_models import build_tiny_model, entry, torch_threads  # noqa: E402

F = torch.nn.functional


def reference(q, k_pool, v_pool, slots):
    """SDPA of the n queries (the context's last n positions) over the context at ``slots``."""
    n, length = q.shape[0], slots.shape[0]
    k, v = k_pool[slots].transpose(0, 1)[None], v_pool[slots].transpose(0, 1)[None]
    visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    mask = torch.zeros(n, length).masked_fill(~visible, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True
    )
    return out[0].transpose(0, 1).reshape(n, -1)


@pytest.mark.parametrize(
    ("n", "length", "heads", "kv_heads", "dim"),
    [
        (2, 2, 9, 3, 64),  # a chunk with no cached context
        (100, 250, 9, 3, 64),  # on a cached context; query blocks and key blocks unaligned
        (130, 130, 4, 4, 128),
        (200, 1000, 16, 1, 32),  # 16 query heads on one KV head
        (12, 40, 4, 2, 24),  # a head dim that is not a multiple of 16
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_sdpa_with_the_causal_offset(kernel, n, length, heads, kv_heads, dim,
                                                    threads):  # fmt: skip
    """Scattered slots, queries as rows of a wider qkv tensor (a strided view, as the model
    passes them): within float32 rounding, for every thread count."""
    g = torch.Generator().manual_seed(n + length + dim)
    k_pool = torch.randn(length + 30, kv_heads, dim, generator=g)
    v_pool = torch.randn(length + 30, kv_heads, dim, generator=g)
    slots = torch.randperm(length + 30, generator=g)[:length]
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, : heads * dim].view(n, heads, dim)
    with torch_threads(threads):
        got = kernel.prefill_attention(q, k_pool, v_pool, slots, dim**-0.5)
    torch.testing.assert_close(got, reference(q, k_pool, v_pool, slots), atol=1e-5, rtol=1e-4)


def test_kernel_refuses_heads_it_cannot_group(kernel):
    q = torch.randn(4, 5, 64)
    pool = torch.randn(8, 2, 64)
    with pytest.raises(ValueError, match="5 query heads over 2 KV heads"):
        kernel.prefill_attention(q, pool, pool, torch.arange(4), 0.125)


def test_cpu_paged_prefills_in_chunks_as_the_reference_does(tmp_path):
    """A prompt prefilled in three chunks (the later ones over the cached part) beside another
    prompt in the same step: cpu-paged's logits are torch-gather's."""
    tiny = build_tiny_model("llama3", tmp_path / "tiny")
    a = [(7 * i + 3) % 300 + 4 for i in range(150)]
    b = [(5 * i + 1) % 300 + 4 for i in range(70)]
    runs = {}
    for name in ("cpu-paged", "torch-gather"):
        cfg = ModelConfig(model=str(tiny), attention_backend=name, weights_cache_dir=str(tmp_path))
        runner = TorchRunner(cfg, 512)
        assert runner.backend.name == name
        slots = list(range(100, 250))
        out = [runner.logits(Batch([entry("a", a[:64], 0, slots[:64])]))]
        out.append(runner.logits(Batch([entry("a", a[64:128], 64, slots[:128]),
                                         entry("b", b, 0, list(range(300, 370)))])))  # fmt: skip
        out.append(runner.logits(Batch([entry("a", a[128:], 128, slots)])))
        runs[name] = out
    for got, expect in zip(runs["cpu-paged"], runs["torch-gather"], strict=True):
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
