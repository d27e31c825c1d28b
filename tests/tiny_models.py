"""Tiny random-weight Llama, Qwen2, Qwen3 and Qwen3-MoE checkpoints saved as real HF directories, and a hand-rolled
scheduler stand-in (slot allocation, Batch building) to drive a runner in the model tests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from radixserve.sched.batch import Batch, BatchEntry
from radixserve.sched.request import SamplingParams

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a radix tree shares the prefixes of many prompts",
    "serving language models is mostly about memory",
    "the capital of france is paris and the capital of italy is rome",
] * 4

_MOE = {"head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# kind -> (transformers config class name, config overrides)
TINY_KINDS = {
    "llama3": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-linear": (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True},
    ),
    "qwen2": ("Qwen2Config", {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    # head_dim 24 is not hidden / heads (16), as in the released Qwen3s
    "qwen3": ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": True}),
    # layer 0 routed (top 2 of 8, renormalised), layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", {**_MOE, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # layer 0 dense, layer 1 routed (every second layer), weights not renormalised
    "qwen3_moe-step2": ("Qwen3MoeConfig", {**_MOE, "decoder_sparse_step": 2}),
}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer with a few merges, trained on a fixed corpus (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def build_tiny_model(kind: str, root: Path, seed: int = 0) -> Path:
    """Save a seeded random ``kind`` model (see TINY_KINDS) with its tokenizer under ``root``."""
    import transformers

    class_name, overrides = TINY_KINDS[kind]
    config = getattr(transformers, class_name)(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model, seed)
    out = root / kind
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    tok_config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Make every weight matter: HF initialises norms to 1 and biases to 0, and a std of 0.02
    leaves logits so flat that a wrong rotary or mask could still pass a 1e-4 comparison."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.5 * noise)
            else:
                p.copy_(0.15 * noise)


class SlotAllocator:
    """Hands out KV slots in a shuffled order, as a scheduler's free list does after churn."""

    def __init__(self, num_slots: int, seed: int = 0) -> None:
        self.free = list(range(num_slots))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out


def entry(
    rid: str,
    tokens: Sequence[int],
    start_pos: int,
    slots: Sequence[int],
    sample: bool = True,
    sampling: SamplingParams = GREEDY,
    num_generated: int = 0,
) -> BatchEntry:
    return BatchEntry(
        rid=rid,
        token_ids=list(tokens),
        start_pos=start_pos,
        slots=list(slots),
        sample=sample,
        sampling=sampling,
        is_prefill=num_generated == 0 or len(tokens) > 1,
        num_generated=num_generated,
    )


def greedy_generate(
    runner,
    prompts: Sequence[Sequence[int]],
    steps: int,
    alloc: SlotAllocator,
    chunk: int | None = None,
    cached: Sequence[tuple[list[int], list[int]]] | None = None,
) -> list[list[int]]:
    """Continue every prompt for ``steps`` tokens, all requests batched together.

    ``chunk`` splits prefills into chunks of that many tokens; ``cached[i]`` = (tokens, slots)
    of a prefix of prompt i whose K/V already sit in the pool (prefix reuse).
    """
    slots: list[list[int]] = []
    pending: list[int] = []
    for i, prompt in enumerate(prompts):
        reuse = cached[i][1] if cached else []
        slots.append(list(reuse) + alloc.take(len(prompt) - len(reuse)))
        pending.append(len(reuse))
    outs: list[list[int]] = [[] for _ in prompts]
    while any(p < len(pr) for p, pr in zip(pending, prompts)):
        entries, owners = [], []
        for i, prompt in enumerate(prompts):
            start = pending[i]
            if start >= len(prompt):
                continue
            end = len(prompt) if chunk is None else min(len(prompt), start + chunk)
            entries.append(
                entry(str(i), prompt[start:end], start, slots[i][:end], end == len(prompt))
            )
            owners.append(i)
            pending[i] = end
        result = runner.run(Batch(entries))
        for i, tok in zip(owners, result.next_token_ids):
            if tok is not None:
                outs[i].append(tok)
    for step in range(1, steps):
        entries = []
        for i, prompt in enumerate(prompts):
            pos = len(prompt) + step - 1
            slots[i] += alloc.take(1)
            entries.append(entry(str(i), [outs[i][-1]], pos, slots[i], True, GREEDY, step))
        for i, tok in enumerate(runner.run(Batch(entries)).next_token_ids):
            outs[i].append(tok)
    return outs


def write_tiny_gguf(hf_dir: Path, out: Path) -> Path:
    """Write a float32 GGUF of a tiny HF model the way llama.cpp's converter lays it out: GGUF
    tensor names, Llama Q/K rows interleaved per head, the tokenizer as a gpt2 vocab."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_gguf_config(writer, config)
    _write_gguf_tokenizer(writer, hf_dir)
    for name, w in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        if arch == "llama" and ".q_proj." in name:
            w = _interleave_rope_rows(w, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            w = _interleave_rope_rows(w, config["num_key_value_heads"])
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_gguf_config(writer, config: dict) -> None:
    import gguf

    rope = config.get("rope_parameters") or {}
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])


def _write_gguf_tokenizer(writer, hf_dir: Path) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def _interleave_rope_rows(w, heads: int):
    """New row ``2 i + j`` of each head is old row ``j * half + i``: llama.cpp rotates adjacent
    pairs where HF checkpoints rotate the two halves of a head."""
    import numpy as np

    head_dim = w.shape[0] // heads
    half = head_dim // 2
    order = [h * head_dim + j * half + i for h in range(heads) for i in range(half) for j in (0, 1)]
    return np.ascontiguousarray(w[np.array(order)])


def _gguf_name(name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in fixed:
        return fixed[name]
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    rest = name.removeprefix("model.layers.")
    index, _, tail = rest.partition(".")
    module, _, kind = tail.rpartition(".")
    return f"blk.{index}.{parts[module]}.{kind}"


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch (OpenMP) threads, then put the count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
