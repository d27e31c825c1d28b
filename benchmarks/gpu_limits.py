"""The engine on a GPU against the GPU's own limits, measured in one run.

The ceilings first: a bf16 matrix product (8192^3, random data) and a device-to-device copy
(2 GiB, bytes read plus written). Then per model shape (seeded random bf16 weights of a real
config, saved as safetensors and loaded through radixserve's loader): decode steps through
``TorchRunner.run`` (sampling included) at batch 1..256, every request at the same context,
with the decode CUDA graphs and kernel by kernel, against the bound of reading the weights and
the batch's KV once at the copy rate; prefill FLOP/s (matmuls plus causal attention) against
the matrix-product rate; and graph replay checked against the eager step's logits.

    python benchmarks/gpu_limits.py --out DIR
    python benchmarks/gpu_limits.py --device cpu --models tiny --batches 1 4 --context 64  # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

from _limits import decode_batch, decode_bound_s, prefill_batch, prefill_flops, timed, weight_bytes
from _machine import machine_line
from radixserve.config import ModelConfig
from radixserve.model.cuda_graphs import DecodeGraphs
from radixserve.model.runner import TorchRunner

SHAPES = {  # config.json fields of real models (rope scaling left out: it costs nothing here)
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}  # fmt: skip
PREFILLS = ((1, 2048), (4, 2048), (8, 2048))  # (prompts, tokens each)


def ceilings(device: torch.device, dtype: torch.dtype, n: int, nbytes: int) -> dict:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    gemm_s = timed(lambda: a @ b, 20, device)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), 20, device)
    return {"gemm_n": n, "gemm_tflops": 2 * n**3 / gemm_s / 1e12,
            "copy_bytes": nbytes, "copy_gbs": 2 * nbytes / copy_s / 1e9}  # fmt: skip


def build_model(root: Path, shape: dict, dtype: torch.dtype, device: torch.device) -> Path:
    """Seeded random weights of ``shape`` as an HF directory (std 0.02, norms 1)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import build_tokenizer

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
           "max_position_embeddings": 8192, "bos_token_id": 0, "eos_token_id": 1, **shape}  # fmt: skip
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return (torch.randn(s, generator=gen, device=device) * 0.02).to(dtype).cpu()

    t = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h),
         "model.norm.weight": torch.ones(h, dtype=dtype)}  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
              p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
              p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
              p + "mlp.down_proj.weight": rnd(h, inter),
              p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
              p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}  # fmt: skip
    root.mkdir(parents=True)
    save_file(t, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(cfg))
    build_tokenizer().save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return root


def decode_rows(runner: TorchRunner, graphs: DecodeGraphs, batches: list[int], ctx: int,
                bw: float, reps: int) -> list[dict]:  # fmt: skip
    rows = []
    for b in batches:
        batch = decode_batch(b, ctx)
        row = {"batch": b, "context": ctx}
        for name, g in (("eager", None), ("graph", graphs)):
            runner.graphs = g
            row[f"{name}_ms"] = (
                timed(lambda batch=batch: runner.run(batch), reps, runner.device) * 1e3
            )
        last = next(reversed(graphs.graphs.values()))  # the bucket this batch ran in
        if last.graph is not None:  # the graph alone: its kernels, no host work around it
            row["replay_ms"] = timed(last.graph.replay, reps, runner.device) * 1e3
        row["bound_ms"] = decode_bound_s(runner, b, ctx, bw) * 1e3
        rows.append(row)
        print(f"  decode B={b}: {row}", flush=True)
    return rows


def prefill_rows(runner: TorchRunner, peak: float, reps: int, sizes: tuple) -> list[dict]:
    rows = []
    runner.graphs = None
    for prompts, length in sizes:
        batch = prefill_batch(prompts, length)
        s = timed(lambda batch=batch: runner.run(batch), reps, runner.device)
        tflops = prefill_flops(runner, prompts, length) / s / 1e12
        rows.append({"prompts": prompts, "length": length, "ms": s * 1e3, "tflops": tflops,
                     "of_peak": tflops / peak})  # fmt: skip
        print(f"  prefill {prompts}x{length}: {rows[-1]}", flush=True)
    return rows


def kernels_per_step(runner: TorchRunner, b: int, ctx: int) -> int | None:
    """CUDA kernels one kernel-by-kernel decode step launches (torch profiler), or None."""
    if runner.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    batch = decode_batch(b, ctx)
    runner.graphs, graphs = None, runner.graphs
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.run(batch)
    runner.graphs = graphs
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in prof.key_averages() if e.device_type == cuda]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels)
    print(f"  B={b} eager step, GPU time by kernel ({total / 1e3:.2f} ms in all):")
    for e in kernels[:10]:
        print(f"    {e.self_device_time_total / 1e3:7.3f} ms  {e.count:4d}x  {e.key[:90]}")
    return sum(e.count for e in kernels)


def check_float32(name: str, path: Path, args: argparse.Namespace, slots: int) -> dict:
    """The graph check again with float32 weights and KV (rounding out of the way)."""
    config = ModelConfig(model=str(path), device=args.device, dtype="float32",
                         cuda_graph_max_bs=64)  # fmt: skip
    runner = TorchRunner(config, num_slots=slots)
    if runner.graphs is None:
        return {}
    runner.kv.kv.normal_()
    out = check_graph(runner, runner.graphs, args.context)
    del runner
    torch.cuda.empty_cache()
    return out


def check_graph(runner: TorchRunner, graphs: DecodeGraphs, ctx: int) -> dict:
    """Batch 5 (a padded bucket) and 64: graph logits against the eager step's, same KV."""
    out = {}
    for b in (5, 64):
        batch = decode_batch(b, ctx)
        runner.graphs = None
        eager = runner.logits(batch).double()
        runner.graphs = graphs
        graph = runner.logits(batch).double()
        rel = float((graph - eager).norm() / eager.norm())
        agree = float((graph.argmax(-1) == eager.argmax(-1)).double().mean())
        out[b] = {"rel_err": rel, "argmax_agree": agree}
    return out


def run_model(name: str, args: argparse.Namespace, ceil: dict, root: Path) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    path = build_model(root / name, SHAPES[name], dtype, device)
    slots = max(args.batches) * args.context + max(p * n for p, n in PREFILLS)
    config = ModelConfig(model=str(path), device=args.device, dtype=args.dtype,
                         cuda_graph_max_bs=max(args.batches))  # fmt: skip
    runner = TorchRunner(config, num_slots=slots)
    if runner.graphs is None:  # a CPU: the graphs' padded path without capture
        runner = TorchRunner(
            ModelConfig(**{**_fields(config), "attention_backend": "torch-gather"}), slots
        )
        runner.kv = runner.model.new_kv_pool(slots, scratch=True)
        runner.backend.bind(runner.kv)
        runner.graphs = DecodeGraphs(
            runner.model, runner.kv, max(args.batches), 8192, capture=False
        )
    runner.kv.kv.normal_()
    graphs = runner.graphs
    print(f"{name}: built and loaded in {time.perf_counter() - t0:.1f} s; weights "
          f"{weight_bytes(runner) / 1e9:.3f} GB", flush=True)  # fmt: skip
    res = {"model": name, "weight_bytes": weight_bytes(runner)}
    res["check"] = check_graph(runner, graphs, args.context)
    print(f"  graph vs eager: {res['check']}", flush=True)
    try:  # the profile is a side note: its failure must not cost the timings
        res["kernels_b8"] = kernels_per_step(runner, 8, args.context)
        print(f"  kernels in an eager decode step at B=8: {res['kernels_b8']}", flush=True)
        kernels_per_step(runner, max(args.batches), args.context)
    except Exception:
        traceback.print_exc()
    runner.graphs = graphs
    res["decode"] = decode_rows(
        runner, graphs, args.batches, args.context, ceil["copy_gbs"] * 1e9, args.reps
    )
    sizes = PREFILLS if args.device != "cpu" else ((1, 64), (2, 64))
    res["prefill"] = prefill_rows(runner, ceil["gemm_tflops"], max(3, args.reps // 4), sizes)
    res["graphs_captured"] = len(graphs.graphs)
    del runner, graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
        res["check_float32"] = check_float32(name, path, args, 64 * args.context + 64)
        print(f"  graph vs eager, float32: {res['check_float32']}", flush=True)
    return res


def _fields(config: ModelConfig) -> dict:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def report(ceil: dict, results: list[dict]) -> str:
    lines = [f"ceilings: bf16 GEMM {ceil['gemm_n']}^3 {ceil['gemm_tflops']:.0f} TFLOP/s; "
             f"device copy {ceil['copy_bytes'] >> 20} MiB {ceil['copy_gbs']:.0f} GB/s (read+write)"]  # fmt: skip
    for r in results:
        lines += ["", f"### {r['model']} ({r['weight_bytes'] / 1e9:.3f} GB of weights)", "",
                  f"graph vs eager logits: {r['check']}; float32: {r.get('check_float32')}",
                  f"kernels in an eager decode step at B=8: {r.get('kernels_b8')}", "",
                  "| B | ctx | eager ms | graph ms | replay only ms | graph speedup | bound ms | "
                  "graph / bound | graph tok/s | bound tok/s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for d in r["decode"]:
            b, g = d["batch"], d["graph_ms"]
            replay = f"{d['replay_ms']:.3f}" if "replay_ms" in d else "-"
            lines.append(f"| {b} | {d['context']} | {d['eager_ms']:.2f} | {g:.3f} | {replay} | "
                         f"{d['eager_ms'] / g:.1f}x | {d['bound_ms']:.3f} | {g / d['bound_ms']:.2f}x | "
                         f"{b / g * 1e3:,.0f} | {b / d['bound_ms'] * 1e3:,.0f} |")  # fmt: skip
        lines += ["", "| prefill | ms | TFLOP/s | of GEMM peak |", "|---|---|---|---|"]
        for p in r["prefill"]:
            lines.append(f"| {p['prompts']} x {p['length']} | {p['ms']:.1f} | {p['tflops']:.1f} | "
                         f"{p['of_peak']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3.2-1b"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--context", type=int, default=512, help="tokens of context per decode")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="folder for results.json / report.md")
    args = p.parse_args()
    device = torch.device(args.device)
    print(machine_line())
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none"
    print(
        f"gpu: {gpu}, torch {torch.__version__}, dtype {args.dtype}, decode context {args.context}"
    )
    torch.set_grad_enabled(False)
    big = device.type == "cuda"
    ceil = ceilings(
        device, getattr(torch, args.dtype), 8192 if big else 512, (2 << 30) if big else 64 << 20
    )
    print(f"ceilings: {ceil}", flush=True)
    root = Path(tempfile.mkdtemp())
    results = []
    for m in args.models:
        try:
            results.append(run_model(m, args, ceil, root))
        except Exception:  # one shape's failure must not cost the others' figures
            traceback.print_exc()
    text = report(ceil, results)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"machine": machine_line(), "gpu": gpu, "torch": torch.__version__}
        (args.out / "results.json").write_text(
            json.dumps({**meta, "ceilings": ceil, "models": results}, indent=1)
        )
        (args.out / "report.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
