"""Attention backends chosen at start-up compute what the reference computes; ``--dtype auto``
follows the CPU's flags; bfloat16 weights and KV cache stay close to transformers."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.attention.cpu_contig import TailBuffers  # noqa: E402
from radixserve.model.attention.plan import MIN_SHARED_PREFIX, build_plan  # noqa: E402
from radixserve.model.attention.registry import (  # noqa: E402
    BACKEND_CHOICES,
    BACKENDS,
    get_backend,
)
from radixserve.model.dtypes import auto_dtype, resolve_dtypes  # noqa: E402
from radixserve.model.kernels import CpuKernels, load_cpu_kernels  # noqa: E402
from radixserve.model.runner import TorchRunner, kv_bytes_per_token  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from tiny_models import SlotAllocator, build_tiny_model, entry  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model("llama3", tmp_path_factory.mktemp("tiny"))


# -- dtype auto: a pure function of the device and the CPU flags --------------------------------
@pytest.mark.parametrize(
    ("device", "flags", "expected"),
    [
        ("cpu", {"sse4_2", "avx", "avx2", "fma"}, "float32"),  # AVX2 only: bf16 is emulated
        ("cpu", {"avx2", "avx512f", "avx512bw", "avx512_vnni"}, "float32"),  # AVX-512, no BF16
        ("cpu", {"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # Cooper Lake, Zen 4
        ("cpu", {"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),  # Sapphire Rapids
        ("cpu", set(), "float32"),
        ("cuda", set(), "bfloat16"),
    ],
)
def test_auto_dtype_follows_native_bf16(device, flags, expected):
    assert auto_dtype(device, flags) == expected


def test_kv_cache_dtype_follows_the_weights_unless_set():
    assert resolve_dtypes("float32", "auto", "cpu") == (torch.float32, torch.float32)
    assert resolve_dtypes("bfloat16", "auto", "cpu") == (torch.bfloat16, torch.bfloat16)
    assert resolve_dtypes("float32", "bfloat16", "cpu") == (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtypes("float32", "int8", "cpu")


def test_kv_cache_dtype_halves_the_slot_cost(tiny):
    full = kv_bytes_per_token(ModelConfig(model=str(tiny)))
    half = kv_bytes_per_token(ModelConfig(model=str(tiny), kv_cache_dtype="bfloat16"))
    assert half * 2 == full
    runner = TorchRunner(ModelConfig(model=str(tiny), kv_cache_dtype="bfloat16"), num_slots=16)
    assert runner.kv.kv.dtype == torch.bfloat16 and runner.dtype == torch.float32


# -- the registry -------------------------------------------------------------------------------
def test_registry_defaults_and_refusals(tmp_path):
    assert set(BACKENDS) == {"cpu-paged", "cpu-contig", "cpu-prefix", "cuda-sdpa", "torch-gather"}
    # --attention-backend offers exactly the registry's names (config.py lists them torch-free)
    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(ModelConfig)}
    assert choices["attention_backend"] == BACKEND_CHOICES
    # float32 on a CPU with the kernels loaded: radixserve's decode kernel; without them, or
    # with a bfloat16 model or KV cache: cpu-contig, which computes in any dtype
    kernels = load_cpu_kernels(tmp_path)
    assert isinstance(kernels, CpuKernels), kernels  # this machine has a C++ compiler
    f32 = torch.float32
    assert get_backend("auto", CPU, f32, f32, kernels).name == "cpu-paged"
    assert get_backend("auto", CPU).name == "cpu-contig"
    assert get_backend("auto", CPU, f32, f32, "no compiler").name == "cpu-contig"
    assert get_backend("auto", CPU, torch.bfloat16, None, kernels).name == "cpu-contig"
    assert get_backend("auto", CPU, f32, torch.bfloat16, kernels).name == "cpu-contig"
    with pytest.raises(ValueError, match="'cpu-paged' computes in float32"):
        get_backend("cpu-paged", CPU, torch.bfloat16, None, kernels)
    with pytest.raises(ValueError, match="'cpu-paged': no compiler"):
        get_backend("cpu-paged", CPU, f32, f32, "no compiler")
    assert get_backend("auto", torch.device("cuda")).name == "cuda-sdpa"
    assert get_backend("torch-gather", CPU).name == "torch-gather"
    with pytest.raises(ValueError, match="'cuda-sdpa' runs on cuda, not on cpu"):
        get_backend("cuda-sdpa", CPU)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend("flash", CPU)


def test_runner_refuses_a_backend_for_another_device(tiny):
    with pytest.raises(ValueError, match="runs on cuda"):
        TorchRunner(ModelConfig(model=str(tiny), attention_backend="cuda-sdpa"), num_slots=8)


# -- parity of the shared-prefix path against the reference -------------------------------------
def shared_prefix_steps(runner: TorchRunner, steps: int = 4) -> list[torch.Tensor]:
    """A 40-token prefix computed once; five requests on it (their own tails, of different
    lengths, prefilled in one batch on the cached prefix) and one unrelated request; then
    decodes of all six in one batch. Returns each step's logits."""
    alloc = SlotAllocator(512, seed=3)
    prefix = [(5 * i + 3) % 300 + 4 for i in range(40)]
    prefix_slots = alloc.take(len(prefix))
    runner.logits(Batch([entry("p", prefix, 0, prefix_slots)]))
    tails = [[(7 * r + j) % 300 + 4 for j in range(3 + 2 * r)] for r in range(5)]
    prompts = [prefix + t for t in tails] + [[9, 8, 7, 6, 5]]
    slots = [prefix_slots + alloc.take(len(t)) for t in tails] + [alloc.take(5)]
    first = [entry(str(i), t, 40, slots[i]) for i, t in enumerate(tails)]
    first.append(entry("5", prompts[5], 0, slots[5]))
    plan = build_plan(first, CPU, torch.float32, share_prefixes=True)
    assert [p.slots.shape[0] for p in plan.span_prefixes] == [40]  # the five prefills share it
    assert [s.shared for s in plan.spans] == [True] * 5 + [False]
    out = [runner.logits(Batch(first))]
    for step in range(1, steps):
        # fixed next tokens (not each runner's argmax, which may differ at a near-tie)
        tokens = [(31 * step + 7 * i) % 300 + 4 for i in range(len(prompts))]
        entries = []
        for i, prompt in enumerate(prompts):
            prompt.append(tokens[i])
            slots[i] = slots[i] + alloc.take(1)
            entries.append(entry(str(i), [tokens[i]], len(prompt) - 1, slots[i], True,
                                 num_generated=step))  # fmt: skip
        if step == 1:
            plan = build_plan(entries, CPU, torch.float32, share_prefixes=True)
            assert plan.decode is not None and len(plan.decode.prefixes) == 1
            assert plan.decode.prefixes[0].slots.shape[0] >= MIN_SHARED_PREFIX
            assert plan.decode.prefixes[0].rows.tolist() == [0, 1, 2, 3, 4]
        out.append(runner.logits(Batch(entries)))
    return out


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        ("cpu-prefix", "float32"),
        ("cpu-prefix", "bfloat16"),
        ("cpu-contig", "float32"),
        ("cpu-contig", "bfloat16"),
        ("cpu-paged", "float32"),
    ],
)
def test_cpu_backends_match_the_reference(tiny, dtype, backend):
    ref = shared_prefix_steps(
        TorchRunner(
            ModelConfig(model=str(tiny), attention_backend="torch-gather", dtype=dtype),
            num_slots=512,
        )  # fmt: skip
    )
    ours = shared_prefix_steps(
        TorchRunner(
            ModelConfig(model=str(tiny), attention_backend=backend, dtype=dtype), num_slots=512
        )  # fmt: skip
    )
    assert ref[0].std() > 0.1, "logits too flat for the comparison to mean anything"
    # bfloat16: the paths round differently (on a CPU with AVX512_BF16, PyTorch's native bf16
    # matmuls left single logits 0.06-0.08 apart, of a spread of 1.45, the mean gap 0.01); a
    # wrong prefix or slot moves every logit, so the mean gap is held tight beside the largest
    tol = 1e-4 if dtype == "float32" else 0.2
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol / 4, msg=f"step {step}")
        if dtype != "float32":
            assert (a - b).abs().mean() < 0.03, f"step {step}: mean gap {(a - b).abs().mean()}"


def changing_batches(runner: TorchRunner) -> list[torch.Tensor]:
    """Decodes whose batch changes from step to step, slots handed out in ascending runs (so a
    prefilled prefix is one run): a and b share a 40-token prefix, c does not; steps decode
    {a, b, c}, then a alone (its own tail now starts at 0), then a and b for several steps (b
    comes back: its buffer was dropped), then c alone with a new context under its old id."""
    next_slot = 0

    def take(n: int) -> list[int]:
        nonlocal next_slot
        next_slot += n
        return list(range(next_slot - n, next_slot))

    prefix = [(5 * i + 3) % 300 + 4 for i in range(40)]
    prompts = {"a": prefix + [11, 12, 13], "b": prefix + [21, 22], "c": [9, 8, 7, 6, 5]}
    prefix_slots = take(40)
    slots = {"a": prefix_slots + take(3), "b": prefix_slots + take(2), "c": take(5)}
    first = [entry("p", prefix, 0, prefix_slots)]
    first += [entry(r, p[40:], 40, slots[r]) for r, p in prompts.items() if r != "c"]
    first.append(entry("c", prompts["c"], 0, slots["c"]))
    out = [runner.logits(Batch(first))]
    schedule = [["a", "b", "c"], ["a"]] + [["a", "b"]] * 12 + [["c"]]
    for step, rids in enumerate(schedule, start=1):
        if step == 2:  # a prefill-only step between decode steps: a and b keep their buffers
            runner.logits(Batch([entry("x", [3, 1, 4, 1, 5], 0, take(5))]))
        if step == len(schedule):  # c is a new request with the same id
            prompts["c"], slots["c"] = [17, 4, 29], take(3)
            runner.logits(Batch([entry("c", prompts["c"], 0, slots["c"])]))
        entries = []
        for i, rid in enumerate(rids):
            token = (31 * step + 7 * i) % 300 + 4
            prompts[rid].append(token)
            slots[rid] = slots[rid] + take(1)
            entries.append(entry(rid, [token], len(prompts[rid]) - 1, slots[rid],
                                 num_generated=step))  # fmt: skip
        out.append(runner.logits(Batch(entries)))
    return out


@pytest.mark.parametrize(("budget", "min_tail"), [(None, 3), (None, 6), (0, 3)])
def test_cpu_contig_keeps_its_buffers_right_as_the_batch_changes(
    tiny, monkeypatch, budget, min_tail
):
    """Buffers reused, rebuilt (a tail that starts earlier, a request that left and came back,
    an id reused), grown past their capacity, mixed with short tails gathered in one call
    (min_tail 6), or (budget 0) replaced by per-step gathers: the logits stay the reference's."""
    monkeypatch.setattr(TailBuffers, "CHUNK", 4)  # grow every few steps
    monkeypatch.setattr(TailBuffers, "MIN_TAIL", min_tail)
    ref = changing_batches(
        TorchRunner(ModelConfig(model=str(tiny), attention_backend="torch-gather"), num_slots=512)
    )
    runner = TorchRunner(ModelConfig(model=str(tiny), attention_backend="cpu-contig"), 512)
    if budget is not None:
        runner.backend.tails.budget = budget
    ours = changing_batches(runner)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    held = runner.backend.tails.held
    # only the last step's decode (c, a 4-token tail), and only when its tail is long enough
    assert list(held) == (["c"] if budget is None and min_tail <= 4 else [])


def test_cpu_paged_follows_batches_that_change(tiny):
    """The kernel reads every step's contexts from the pool as they are that step (requests
    leaving, coming back, an id reused with a new context): the logits stay the reference's."""
    ref = changing_batches(
        TorchRunner(ModelConfig(model=str(tiny), attention_backend="torch-gather"), num_slots=512)
    )
    runner = TorchRunner(ModelConfig(model=str(tiny), attention_backend="cpu-paged"), 512)
    for step, (a, b) in enumerate(zip(changing_batches(runner), ref, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_cpu_contig_reads_a_prefix_run_in_place():
    a = entry("a", [1], 40, list(range(100, 140)) + [7])
    b = entry("b", [2], 41, list(range(100, 140)) + [8, 9])
    plan = build_plan([a, b], CPU, torch.float32, share_prefixes=True, pad_tails=False)
    assert plan.decode is not None and plan.decode.prefixes[0].run == (100, 140)
    assert plan.decode.starts == [40, 40]
    c = entry("c", [1], 40, list(range(100, 120)) + list(range(121, 141)) + [7])
    d = entry("d", [2], 40, list(range(100, 120)) + list(range(121, 141)) + [8])
    plan = build_plan([c, d], CPU, torch.float32, share_prefixes=True, pad_tails=False)
    assert plan.decode is not None and plan.decode.prefixes[0].run is None


# -- bfloat16 against transformers in bfloat16 ---------------------------------------------------
def test_bfloat16_greedy_and_logprobs_close_to_transformers(tiny):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    runner = TorchRunner(ModelConfig(model=str(tiny), dtype="bfloat16"), num_slots=128)
    alloc = SlotAllocator(128)
    tokens = [0, 17, 93, 140, 201, 33, 250, 7, 64, 99, 180, 12]
    slots = alloc.take(len(tokens))
    batch = Batch([entry("a", tokens, 0, slots)])
    for step in range(6):
        ours = runner.logits(batch)[0]
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1].float()
        # bfloat16 keeps 8 bits of mantissa: logprobs agree to a few hundredths
        torch.testing.assert_close(
            ours.log_softmax(-1), ref.log_softmax(-1), atol=0.1, rtol=0.0, msg=f"step {step}"
        )
        top2 = ref.topk(2).values
        if top2[0] - top2[1] > 0.1:  # not a near-tie: the greedy token is the same
            assert int(ours.argmax()) == int(ref.argmax()), f"step {step}"
        tokens.append(int(ref.argmax()))
        slots += alloc.take(1)
        batch = Batch([entry("a", tokens[-1:], len(tokens) - 1, slots, num_generated=step + 1)])


# -- CUDA ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuda-sdpa backend)")
def test_cuda_sdpa_backend_matches_cpu_reference(tiny):
    ref = shared_prefix_steps(
        TorchRunner(ModelConfig(model=str(tiny), attention_backend="torch-gather"), num_slots=512)
    )
    config = ModelConfig(model=str(tiny), device="cuda", attention_backend="cuda-sdpa")
    ours = shared_prefix_steps(TorchRunner(config, num_slots=512))
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        torch.testing.assert_close(a.cpu(), b, atol=1e-3, rtol=1e-3, msg=f"step {step}")
