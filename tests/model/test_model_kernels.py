"""radixserve's C++ CPU kernels (``model/csrc/cpu_kernels.cpp``), built with the machine's
compiler: the linear layer computes what ``F.linear`` computes, decode attention what PyTorch's
SDPA computes over the same K/V read from the pool by slot; where they cannot be built the
engine says why and uses PyTorch's paths."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model import kernels  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from tiny_models import build_tiny_model, entry, torch_threads  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 13, 96, 97, 200])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (37, 50), (16, 1)])
def test_linear_matches_f_linear(kernel, rows, out_features, in_features):
    """Every row count the tiles split differently (1-8 in one pass, 6 at a time beyond, 96 per
    pass; each thread keeps its blocks over every pass, also with more threads than blocks),
    widths that are not a multiple of the 16-column blocks: within float32 rounding; the same
    with the product added into a residual."""
    g = torch.Generator().manual_seed(rows * 7 + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    packed = kernel.pack(w)
    for threads in (1, 2, 3):
        with torch_threads(threads):
            y = kernel.linear(x, packed)
        assert y.shape == (rows, out_features)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4)
        # the residual form: y += x W^T in place, the add in the epilogue
        res = torch.randn(rows, out_features, generator=g)
        with torch_threads(threads):
            out = kernel.linear_add(x, packed, res.clone())
        torch.testing.assert_close(out, res + y, atol=1e-4, rtol=1e-4)
    # a strided input (a column slice) is made contiguous first
    wide = torch.randn(rows, in_features * 2, generator=g)
    torch.testing.assert_close(
        kernel.linear(wide[:, ::2], packed),
        torch.nn.functional.linear(wide[:, ::2], w), atol=1e-4, rtol=1e-4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="input of width"):
        kernel.linear(torch.randn(2, in_features + 1), packed)


@pytest.mark.parametrize("rows", [0, 1, 5, 8, 9, 96, 97, 200])
@pytest.mark.parametrize(("inter", "in_features"), [(1536, 576), (32, 50)])
def test_linear_silu_matches_gate_and_up_apart(kernel, rows, inter, in_features):
    """silu(gate) * up applied inside the fused gate/up linear (the engine's float32 MLP) equals
    the linear followed by the activation, at row counts the passes split differently; a gate/up
    weight not of whole 16-column blocks is refused."""
    g = torch.Generator().manual_seed(rows + inter)
    w = torch.randn(2 * inter, in_features, generator=g) / in_features**0.5
    x = torch.randn(rows, in_features, generator=g) * 3  # silu far into both tails
    packed = kernel.pack(w)
    gate, up = torch.nn.functional.linear(x, w).chunk(2, dim=-1)
    for threads in (1, 2, 3):
        with torch_threads(threads):
            out = kernel.linear_silu(x, packed)
        torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=1e-4, rtol=1e-4)
    assert not kernel.fuses_silu(kernel.pack(torch.randn(2 * 24, 8)))
    with pytest.raises(ValueError, match="linear_silu"):
        kernel.linear_silu(torch.randn(2, 8), kernel.pack(torch.randn(2 * 24, 8)))


def reference(q, k, v, contexts):
    """Per row: SDPA of its query heads over the K/V at its slots (GQA by repeating heads)."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    out = []
    for r, slots in enumerate(contexts):
        kr = k[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [heads, L, dim]
        vr = v[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        out.append(torch.nn.functional.scaled_dot_product_attention(q[r, :, None], kr, vr)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    # groups of 3 (scored together), 1, 4 (3 + 1), 2 and 7 (3 + 3 + 1); head dims in and out of
    # the compiled sizes
    [(9, 3, 64), (8, 8, 128), (4, 1, 32), (6, 2, 80), (8, 4, 64), (14, 2, 128)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_sdpa_over_scattered_slots(kernel, heads, kv_heads, dim, threads):
    """Rows of 1 to 700 keys (within and across the kernel's 32-key blocks), slots scattered
    over the pool and shared between rows, large and tiny scores: within float32 rounding."""
    g = torch.Generator().manual_seed(heads * dim + threads)
    num_slots = 3000
    k = torch.randn(num_slots, kv_heads, dim, generator=g)
    v = torch.randn(num_slots, kv_heads, dim, generator=g)
    k[:50] *= 30  # some keys dominate their row's softmax
    lengths = [1, 2, 31, 32, 33, 64, 257, 700]
    perm = torch.randperm(num_slots, generator=g)
    contexts = [perm[(i * 97) % 2000 : (i * 97) % 2000 + n] for i, n in enumerate(lengths)]
    contexts[3][:10] = torch.arange(10)  # rows share slots (a common prefix)
    q = torch.randn(len(lengths), heads, dim, generator=g)
    slots = torch.cat(contexts)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = torch.full_like(q, float("nan"))
    with torch_threads(threads):
        kernel.decode_attention(q, k, v, slots, offsets, dim**-0.5, out)
    torch.testing.assert_close(out, reference(q, k, v, contexts), atol=2e-5, rtol=2e-5)


def test_kernel_refuses_heads_it_cannot_group(kernel):
    q = torch.randn(1, 5, 64)
    kv = torch.randn(10, 2, 64)
    with pytest.raises(ValueError, match="5 query heads over 2 KV heads"):
        kernel.decode_attention(
            q, kv, kv, torch.arange(3), torch.tensor([0, 3]), 0.125, torch.empty_like(q)
        )
    q, kv = torch.randn(1, 4, 60), torch.randn(10, 2, 60)
    with pytest.raises(ValueError, match="of dim 60"):  # head dims are taken in steps of 8
        kernel.decode_attention(
            q, kv, kv, torch.arange(3), torch.tensor([0, 3]), 0.125, torch.empty_like(q)
        )


def test_a_machine_without_a_compiler_falls_back_to_pytorch(tmp_path, monkeypatch, caplog):
    """The engine says why, once, and runs PyTorch's paths (cpu-contig, oneDNN), computing what
    the kernels compute; asking for cpu-paged is refused with the compiler's reason; nothing
    half-built is left behind."""
    tiny = build_tiny_model("llama3", tmp_path / "tiny")
    prompt = [(7 * i + 3) % 300 + 4 for i in range(20)]
    with_kernels = TorchRunner(ModelConfig(model=str(tiny), weights_cache_dir=str(tmp_path)), 64)
    expect = with_kernels.logits(Batch([entry("a", prompt, 0, list(range(20)))]))
    cache = tmp_path / "bare"
    cfg = {"model": str(tiny), "weights_cache_dir": str(cache)}
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="radixserve.model"):
        runner = TorchRunner(ModelConfig(**cfg), 64)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0], warnings
    assert runner.backend.name == "cpu-contig" and runner.kernels is None
    assert runner.model.layers[0].qkv.ours is None
    got = runner.logits(Batch([entry("a", prompt, 0, list(range(20)))]))
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="attention backend 'cpu-paged': building"):
        TorchRunner(ModelConfig(**cfg, attention_backend="cpu-paged"), 64)
    broken = tmp_path / "cxx"
    broken.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    with pytest.raises(ValueError, match="this compiler is broken"):
        TorchRunner(ModelConfig(**cfg, attention_backend="cpu-paged"), 64)
    assert not list((cache / "kernels").glob("*"))  # nothing half-built left behind


def test_the_build_is_cached_and_reused(tmp_path):
    first = kernels.load_cpu_kernels(tmp_path)
    assert isinstance(first, kernels.CpuKernels)
    built = list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
    assert built == [first.path]
    mtime = first.path.stat().st_mtime_ns
    kernels._loaded.clear()  # a new process: finds the file, does not rebuild
    again = kernels.load_cpu_kernels(tmp_path)
    assert isinstance(again, kernels.CpuKernels) and again.path == first.path
    assert first.path.stat().st_mtime_ns == mtime


def test_engine_uses_the_kernels_in_float32_unless_turned_off(tmp_path):
    """Default float32: our linears and cpu-paged; ``--cpu-kernels off`` or bfloat16: PyTorch's
    (oneDNN, cpu-contig); the logits agree either way."""
    tiny = build_tiny_model("llama3", tmp_path / "tiny")
    cfg = {"model": str(tiny), "weights_cache_dir": str(tmp_path)}
    ours = TorchRunner(ModelConfig(**cfg), 64)
    assert ours.backend.name == "cpu-paged" and ours.kernels is not None
    assert ours.model.layers[0].qkv.ours is not None and ours.model.lm_head_linear.ours is not None
    off = TorchRunner(ModelConfig(**cfg, cpu_kernels="off"), 64)
    assert off.backend.name == "cpu-contig" and off.kernels is None
    assert off.model.layers[0].qkv.ours is None
    with pytest.raises(ValueError, match="cpu-paged runs radixserve's CPU kernels"):
        ModelConfig(**cfg, cpu_kernels="off", attention_backend="cpu-paged")
    bf16 = TorchRunner(ModelConfig(**cfg, dtype="bfloat16"), 64)
    assert bf16.backend.name == "cpu-contig" and bf16.kernels is None
    prompt = [(7 * i + 3) % 300 + 4 for i in range(20)]
    a = ours.logits(Batch([entry("a", prompt, 0, list(range(20)))]))
    b = off.logits(Batch([entry("a", prompt, 0, list(range(20)))]))
    assert a.std() > 0.1
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_small_ops_match_pytorch(kernel):
    """rms_norm (with and without the residual add fused in), silu(gate) * up, and rope with
    the K/V store: what the PyTorch ops compute, within float32 rounding, at a decode step's
    rows and at a prefill chunk's (where they split over threads)."""
    from radixserve.model import rope

    g = torch.Generator().manual_seed(5)
    for rows in (1, 8, 300):
        x = torch.randn(rows, 576, generator=g) * 3
        w = torch.randn(576, generator=g)
        delta = torch.randn(rows, 576, generator=g)
        expect = torch.nn.functional.rms_norm(x, (576,), w, eps=1e-5)
        torch.testing.assert_close(kernel.rms_norm(x.clone(), w, 1e-5), expect)
        summed = x + delta
        x_in = x.clone()
        got = kernel.rms_norm(x_in, w, 1e-5, add=delta)
        torch.testing.assert_close(x_in, summed)  # x += delta, in place
        torch.testing.assert_close(got, torch.nn.functional.rms_norm(summed, (576,), w, eps=1e-5))

        gu = torch.randn(rows, 2 * 1536, generator=g) * 6  # silu far into both tails
        gate, up = gu.chunk(2, dim=-1)
        torch.testing.assert_close(
            kernel.silu_mul(gu), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5
        )

        heads, kv_heads, dim = 9, 3, 64
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
        positions = torch.randint(0, 8000, (rows,), generator=g)
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        cos, sin = rope.cos_sin(positions, inv, torch.float32)
        qk = qkv[:, : (heads + kv_heads) * dim].reshape(rows, heads + kv_heads, dim)
        rotated = rope.apply_rope(qk, cos, sin)
        values = qkv[:, (heads + kv_heads) * dim :].reshape(rows, kv_heads, dim)
        k_pool = torch.zeros(1000, kv_heads, dim)
        v_pool = torch.zeros(1000, kv_heads, dim)
        slots = torch.randperm(1000, generator=g)[:rows]
        out = qkv.clone()
        kernel.rope_and_cache(out, heads, kv_heads, dim, cos.reshape(rows, dim),
                              sin.reshape(rows, dim), slots, k_pool, v_pool)  # fmt: skip
        torch.testing.assert_close(
            out[:, : (heads + kv_heads) * dim], rotated.reshape(rows, -1), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            out[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :]
        )
        torch.testing.assert_close(k_pool[slots], rotated[:, heads:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_pool[slots], values)
        untouched = torch.ones(1000, dtype=torch.bool)
        untouched[slots] = False
        assert not k_pool[untouched].any() and not v_pool[untouched].any()
