"""Tensor parallelism over two CPU processes (gloo): the split model computes what the whole one
does (logits within 1e-4 through prefill, decode, a prefix-cache hit, a mixed batch), each
rank's host tier gives back its own heads' pages, the HTTP server's greedy text is tp 1's, a
model whose heads do not split is refused in one line, and a killed rank takes the engine down
with a message naming it. The same split under NCCL is ``-m gpu`` (two GPUs)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from server_harness import ServerProcess  # noqa: E402
from tiny_models import SlotAllocator, build_tiny_model, entry  # noqa: E402

rng = random.Random(3)
PROMPT = [rng.randrange(4, 300) for _ in range(40)]
SHARING = PROMPT[:24] + [rng.randrange(4, 300) for _ in range(9)]  # its first 24 are cached
OTHER = [rng.randrange(4, 300) for _ in range(17)]
SERVER_ARGS = ("--max-total-tokens", "4096", "--context-length", "256", "--log-level", "info")


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3", "qwen3_moe"])
def model_dir(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp("tiny-tp"))


def steps(alloc: SlotAllocator) -> list[Batch]:
    """Prefill; a decode beside a prefill that reuses the first prompt's cached prefix (its
    K/V written by the earlier step, at the same slots on every rank); two decodes beside a
    fresh prefill."""
    a, o = alloc.take(len(PROMPT) + 2), alloc.take(len(OTHER))
    b = a[:24] + alloc.take(len(SHARING) - 24 + 1)
    n = len(PROMPT)
    first = [entry("a", PROMPT, 0, a[:n])]
    second = [entry("a", [7], n, a[: n + 1], num_generated=1),
              entry("b", SHARING[24:], 24, b[: len(SHARING)])]  # fmt: skip
    third = [entry("a", [9], n + 1, a[: n + 2], num_generated=2),
             entry("b", [11], len(SHARING), b, num_generated=1), entry("o", OTHER, 0, o)]  # fmt: skip
    return [Batch(first), Batch(second), Batch(third)]


def test_two_ranks_compute_the_whole_models_logits(model_dir) -> None:
    from radixserve.engine.tp_ranks import TPRunner

    whole = TorchRunner(ModelConfig(model=str(model_dir)), 256)
    split = TPRunner(ModelConfig(model=str(model_dir), tp_size=2), 256)
    try:
        assert split.model.arch.num_heads * 2 == whole.model.arch.num_heads
        assert split.kv.kv.shape[3] * 2 == whole.kv.kv.shape[3]  # its KV heads only
        for batch in steps(SlotAllocator(256, seed=4)):
            want, got = whole.logits(batch), split.logits(batch)
            assert got.shape == want.shape
            assert (got - want).abs().max().item() < 1e-4
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    finally:
        split.close()


def test_each_rank_keeps_its_heads_pages_in_its_host_tier(model_dir) -> None:
    """A prefix pushed out of the small device pool comes back from every rank's host tier:
    the same tokens and logprobs as recomputing it (a rank that had not loaded its pages
    would attend over stale K/V)."""
    from radixserve import Engine

    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    shared = [rng.randrange(4, 300) for _ in range(64)]
    engine = Engine(model=str(model_dir), max_total_tokens=160, context_length=256,
                    enable_hierarchical_cache=True, hicache_ratio=2.0, tp_size=2)  # fmt: skip
    try:
        engine.generate(input_ids=shared + [5, 6, 7], sampling_params=sp)
        for _ in range(2):
            engine.generate(input_ids=[rng.randrange(4, 300) for _ in range(70)],
                            sampling_params=sp)  # fmt: skip
        out = engine.generate(input_ids=shared + [8, 9], sampling_params=sp)
        assert engine.flush_cache()
        again = engine.generate(input_ids=shared + [8, 9], sampling_params=sp)
    finally:
        engine.shutdown()
    assert out["meta_info"]["cached_tokens_details"]["host"] >= len(shared) - 1
    assert out["output_ids"] == again["output_ids"]
    got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    want = [t[0] for t in again["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-4)


def greedy_texts(server: ServerProcess) -> list[str]:
    """Three greedy completions, the second a prefix-cache hit on the first."""
    texts = []
    for prompt in ("the quick brown fox", "the quick brown fox jumps over", "a radix tree"):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                    "ignore_eos": True}}  # fmt: skip
        reply = server.post("/generate", body)
        assert reply.status == 200, reply.body
        texts.append(reply.json()["text"])
    return texts


def test_server_with_two_ranks_writes_tp1s_greedy_text(tiny_model_dir) -> None:
    one = ServerProcess(["--model", str(tiny_model_dir), *SERVER_ARGS])
    try:
        want = greedy_texts(one)
    finally:
        one.stop()
    two = ServerProcess(["--model", str(tiny_model_dir), "--tp-size", "2", *SERVER_ARGS])
    try:
        assert two.get("/get_server_info").json()["engine"]["tp_size"] == 2
        assert greedy_texts(two) == want
        hit = two.post("/generate", {"text": "the quick brown fox jumps over",
                                     "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
        assert hit.json()["meta_info"]["cached_tokens"] > 0
    finally:
        two.stop()


def test_a_model_whose_heads_do_not_split_is_refused_in_one_line() -> None:
    """The built-in SmolLM2-135M has 9 attention heads and 3 KV heads: no split by 2."""
    cmd = [sys.executable, "-m", "radixserve", "serve", "--port", "0", "--tp-size", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "--tp-size 2: the model has 9 attention heads, not divisible by 2" in text
    assert "Traceback" not in text
    sim = subprocess.run([*cmd, "--sim", "tiny-cpu"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert sim.returncode != 0 and "--tp-size needs a real model" in sim.stderr + sim.stdout


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(monkeypatch) -> None:
    """NCCL runs one rank per GPU: ranks that would not each find one are named in one line."""
    from radixserve.engine.tp_ranks import gpu_shortage

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpu_shortage("cuda", 2) is None and gpu_shortage("cuda:0", 1) is None
    assert gpu_shortage("cpu", 4) is None
    assert gpu_shortage("cuda:1", 2) == (
        "--tp-size 2 on cuda:1: the ranks need cuda:1..cuda:2, one GPU each "
        "(NCCL runs one rank per GPU), and this machine has 2"
    )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one CUDA GPU")
def test_two_ranks_on_a_one_gpu_machine_are_refused_in_one_line(tiny_model_dir) -> None:
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", str(tiny_model_dir),
           "--port", "0", "--device", "cuda", "--tp-size", "2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text
    assert "--tp-size 2 on cuda: the ranks need cuda:0..cuda:1" in text
    assert "this machine has 1" in text


def test_a_killed_rank_fails_requests_with_a_message_within_seconds(tiny_model_dir) -> None:
    server = ServerProcess(["--model", str(tiny_model_dir), "--tp-size", "2", *SERVER_ARGS])
    try:
        (rank1,) = server.get("/get_server_info").json()["engine"]["tp_rank_pids"]
        replies: list = []
        body = {"text": "the quick brown fox", "sampling_params": {
            "max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        mid = threading.Thread(target=lambda: replies.append(server.post("/generate", body)))
        mid.start()
        time.sleep(0.5)  # generating now
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        mid.join(30)
        assert replies and replies[0].status >= 500, replies
        assert time.monotonic() - killed < 10
        assert_the_dead_rank_is_named(server, body, rank1)
    finally:
        server.stop(check=False)


def assert_the_dead_rank_is_named(server: ServerProcess, body: dict, rank1: int) -> None:
    """After rank 1 was SIGKILLed: every later request gets a 503 that names it."""
    after = server.post("/generate", body)
    assert after.status == 503
    message = after.json()["error"]["message"]
    assert f"tensor-parallel rank 1 (pid {rank1}) was killed by signal 9" in message


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpu_ranks_over_nccl_compute_the_whole_models_logits(model_dir) -> None:
    from radixserve.engine.tp_ranks import TPRunner

    whole = TorchRunner(ModelConfig(model=str(model_dir), device="cuda"), 256)
    split = TPRunner(ModelConfig(model=str(model_dir), device="cuda", tp_size=2), 256)
    try:
        for batch in steps(SlotAllocator(256, seed=4)):
            diff = (split.logits(batch) - whole.logits(batch)).abs().max().item()
            assert diff < 1e-4
    finally:
        split.close()
