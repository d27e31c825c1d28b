"""Engine step times on a CUDA GPU, by dtype and batch size (needs a GPU; CI has none).

The model is SmolLM2-135M's shape (30 layers, 576 hidden, 9 query / 3 KV heads, 49,152
vocabulary) with seeded random weights, built here with transformers, so it needs nothing
carried to the GPU machine beyond radixserve's own dependencies; step times do not depend on the
weights' values. Each batch size B: B requests share a 384-token prefix and add 32 tokens of
their own; one prefill step, then 25 decode steps through the real scheduler and runner
(``Worker.step``), the median of the last 20 kept, with the GPU synchronised around each step.

    python benchmarks/gpu_step_times.py [--dtypes float32 bfloat16] [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

from _machine import machine_line
from radixserve.config import CacheConfig, ModelConfig, SchedulerConfig
from radixserve.engine.messages import GenerateReq
from radixserve.engine.scheduler_proc import Worker
from radixserve.model.runner import TorchRunner
from radixserve.sched.request import SamplingParams
from radixserve.sched.scheduler import Scheduler

PREFIX, SUFFIX, DECODES = 384, 32, 25


def build_model(root: Path) -> Path:
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import build_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root)
    build_tokenizer().save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return root


def step_times(model: Path, dtype: str, batch: int, backend: str) -> tuple[float, float]:
    """(prefill step ms, median decode step ms)."""
    config = ModelConfig(model=str(model), device="cuda", dtype=dtype, attention_backend=backend)
    run = TorchRunner(config, num_slots=32768)
    sched = Scheduler(SchedulerConfig(), CacheConfig(max_total_tokens=32768), eos_token_ids=[1],
                      context_length=8192)  # fmt: skip
    ctx = zmq.Context()
    pull, push, sink = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind("inproc://steps")
    sink.connect("inproc://steps")
    worker = Worker(sched, run, pull, push, realtime=False)
    sp = SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True)
    prefix = [(7 * i + 11) % 300 for i in range(PREFIX)]
    for i in range(batch):
        tail = [(101 * i + 13 * j + 3) % 300 for j in range(SUFFIX)]
        worker.handle(GenerateReq(f"r{i}", prefix + tail, sp))

    def timed() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        worker.step()
        torch.cuda.synchronize()
        while sink.poll(0):
            sink.recv_pyobj()
        return (time.perf_counter() - t0) * 1e3

    prefill = timed()
    decodes = [timed() for _ in range(DECODES)]
    for s in (pull, push, sink):
        s.close(0)
    ctx.term()
    return prefill, statistics.median(decodes[5:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--attention-backend", default="auto")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step_times.py: needs a CUDA GPU (torch sees none)")
    print(machine_line())
    print(f"gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"workload: B requests, {PREFIX}-token shared prefix + {SUFFIX} own tokens; "
          f"decode median of steps 6-{DECODES}")  # fmt: skip
    model = build_model(Path(tempfile.mkdtemp()) / "smollm2-shape")
    rows = {}
    for dtype in args.dtypes:
        for b in args.batches:
            rows[dtype, b] = step_times(model, dtype, b, args.attention_backend)
    print("| dtype | B | prefill step ms | decode step ms | decode vs float32 |")
    print("|---|---|---|---|---|")
    for (dtype, b), (pre, dec) in rows.items():
        base = rows.get(("float32", b))
        ratio = f"{dec / base[1]:.2f}x" if base else "-"
        print(f"| {dtype} | {b} | {pre:.1f} | {dec:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
