"""The engine on a CUDA GPU (skipped without one, as CI has none): the built-in SmolLM2 served
from the GPU computes what the CPU computes, ``--dtype auto`` picks bfloat16 there, and the host
tier (pinned host memory beside a GPU pool) gives back what the device computed."""

from __future__ import annotations

import random
import shutil
import time

import pytest

torch = pytest.importorskip("torch")

from radixserve import Engine  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

rng = random.Random(5)
SHARED = [rng.randrange(100, 40000) for _ in range(600)]
PROMPTS = [SHARED + [rng.randrange(100, 40000) for _ in range(20)] for _ in range(3)]
SP = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "return_logprob": True}


def serve_all(engine: Engine, prompts: list[list[int]]) -> list[dict]:
    return [engine.generate(input_ids=p, sampling_params=SP) for p in prompts]


def logprobs(out: dict) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def test_builtin_model_on_cuda_matches_cpu() -> None:
    """float32 on both: same greedy tokens (the prompts have no near-ties in 12 steps) and the
    same logprobs within 2e-3 (GPU kernels sum in another order); the shared prefix is reused."""
    outs = {}
    for device in ("cpu", "cuda"):
        engine = Engine(device=device, dtype="float32", context_length=1024)
        try:
            outs[device] = serve_all(engine, PROMPTS)
        finally:
            engine.shutdown()
    for cpu, gpu in zip(outs["cpu"], outs["cuda"], strict=True):
        assert gpu["output_ids"] == cpu["output_ids"]
        assert logprobs(gpu) == pytest.approx(logprobs(cpu), abs=2e-3)
    assert all(o["meta_info"]["cached_tokens"] >= 512 for o in outs["cuda"][1:])


def test_dtype_auto_is_bfloat16_on_cuda() -> None:
    from radixserve.config import ModelConfig
    from radixserve.model.runner import TorchRunner

    runner = TorchRunner(ModelConfig(device="cuda", dtype="auto"), num_slots=256)
    assert runner.dtype == torch.bfloat16 and runner.kv_dtype == torch.bfloat16
    engine = Engine(device="cuda", dtype="auto", context_length=1024)
    try:
        outs = serve_all(engine, PROMPTS[:2])
    finally:
        engine.shutdown()
    assert all(len(o["output_ids"]) == SP["max_new_tokens"] for o in outs)


def test_host_tier_beside_a_gpu_pool_gives_back_the_prefix() -> None:
    """A device pool of 1,024 tokens, three other 700-token prompts between: the first prompt's
    KV leaves the GPU for pinned host memory and comes back for a later request sharing it, whose
    greedy output and logprobs equal recomputation after a flush."""
    later = SHARED + [7, 8, 9]
    others = [[rng.randrange(100, 40000) for _ in range(700)] for _ in range(3)]
    engine = Engine(device="cuda", dtype="float32", context_length=1024, max_total_tokens=1024,
                    enable_hierarchical_cache=True, hicache_ratio=4.0)  # fmt: skip
    try:
        serve_all(engine, [PROMPTS[0], *others])
        out = engine.generate(input_ids=later, sampling_params=SP)
        assert engine.flush_cache()
        again = engine.generate(input_ids=later, sampling_params=SP)
    finally:
        engine.shutdown()
    assert out["meta_info"]["cached_tokens_details"]["host"] >= 512
    assert again["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == again["output_ids"]
    assert logprobs(out) == pytest.approx(logprobs(again), abs=1e-4)


def test_storage_tier_between_two_gpu_engines(tmp_path) -> None:
    """The storage tier's device side on a GPU (pages gathered from a CUDA pool, written by one
    engine; landed in pinned host memory and copied up by another): engine B's output equals
    engine A's and its logprobs its own recomputation's within 1e-4 (tiny random-weight model)."""
    import json

    from tiny_models import build_tiny_model

    model = build_tiny_model("llama3", tmp_path)
    store = tmp_path / "kv"
    prompt = [rng.randrange(4, 300) for _ in range(100)]
    extra = json.dumps({"path": str(store), "chunk_size": 16})
    kw = dict(model=str(model), device="cuda", dtype="float32", max_total_tokens=512,
              context_length=256, enable_hierarchical_cache=True,
              hicache_storage_backend="file", hicache_storage_backend_extra_config=extra,
              hicache_storage_prefetch_policy="wait_complete")  # fmt: skip
    a = Engine(**kw)
    try:
        out_a = a.generate(input_ids=prompt, sampling_params=SP)
        for _ in range(600):
            if a.stats()["storage_pages_written"] >= 6:
                break
            time.sleep(0.05)
    finally:
        a.shutdown()
    b = Engine(**kw)
    try:
        got = b.generate(input_ids=prompt, sampling_params=SP)
        assert b.flush_cache()
        shutil.rmtree(store)
        again = b.generate(input_ids=prompt, sampling_params=SP)
    finally:
        b.shutdown()
    assert got["meta_info"]["cached_tokens_details"]["storage"] == 96
    assert again["meta_info"]["cached_tokens"] == 0
    assert got["output_ids"] == out_a["output_ids"] == again["output_ids"]
    assert logprobs(got) == pytest.approx(logprobs(again), abs=1e-4)


def test_engine_decodes_through_cuda_graphs_as_kernel_by_kernel(tmp_path) -> None:
    """Six requests of different lengths batched by the real scheduler: with decode CUDA
    graphs (the default) the same greedy tokens as ``--disable-cuda-graph``, logprobs within
    1e-4 (float32)."""
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_model

    model = build_tiny_model("llama3", tmp_path)
    prompts = [[0] + [rng.randrange(10, 300) for _ in range(n)] for n in (3, 9, 17, 30, 41, 66)]
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    outs = []
    for off in (False, True):
        engine = Engine(model=str(model), device="cuda", dtype="float32",
                        max_total_tokens=4096, disable_cuda_graph=off)  # fmt: skip
        try:
            outs.append(engine.generate(input_ids=prompts, sampling_params=sp))
        finally:
            engine.shutdown()
    for graph, eager in zip(*outs, strict=True):
        assert graph["output_ids"] == eager["output_ids"]
        assert logprobs(graph) == pytest.approx(logprobs(eager), abs=1e-4)
