"""GGUF to Hugging Face directory: dequantized weights under HF names (llama.cpp's Q/K row order
undone), config.json, and a tokenizer.json rebuilt from the embedded BPE vocab. Torch-free.

A conversion is cached by the file's content (its sha256), so only the first load of a model
pays for reading the GGUF, wherever its copies live; that first load prints its progress.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

CONVERTER_VERSION = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# how llama.cpp pre-tokenizes each `tokenizer.ggml.pre`; unknown names fall back to GPT-2's
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLIT_REGEX = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


Progress = Callable[[str], None]  # hears one line of what a conversion is doing


def gguf_to_hf_dir(
    gguf_path: str | Path, cache_root: str | Path, progress: Progress | None = None
) -> Path:
    """The HF-style directory converted from ``gguf_path``, converting it on first use.

    The entry is named by the GGUF's content (sha256), so every copy of one file, wherever it
    lives (one per virtual environment), shares one entry. A conversion is written to a
    temporary directory and renamed into place; a lock makes a second process wait for the
    first's conversion instead of repeating it. ``progress`` (default: lines on stderr) hears
    what the conversion is doing."""
    src = Path(gguf_path).resolve()
    root = Path(cache_root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    digest = content_digest(src, root)
    target = root / f"gguf-{digest[:24]}-v{CONVERTER_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    say = progress or _stderr
    with _lock(root / f".gguf-{digest[:24]}.lock", lambda: say(f"waiting: another process is "
               f"converting {src.name}")):  # fmt: skip
        if (target / "model.safetensors").is_file():  # the other process did it
            return target
        say(f"converting {src.name} once into {target} (later starts reuse it)")
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
        try:
            write_hf_dir(src, tmp, say)
            (tmp / "source.json").write_text(json.dumps({"gguf": src.name, "sha256": digest}))
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the entry from other users
            os.replace(tmp, target)  # atomic: a reader sees no entry or a whole one
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"converted {src.name} in {time.monotonic() - started:.1f} s")
    return target


def _stderr(line: str) -> None:
    print(f"radixserve: {line}", file=sys.stderr, flush=True)


def content_digest(path: Path, cache_root: Path) -> str:
    """sha256 of the file's bytes, read once: remembered under ``cache_root/digests`` for the
    file's (path, size, mtime, inode), so a later start only stats the file."""
    st = path.stat()
    identity = f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = cache_root / "digests" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
    except OSError:
        known = ""
    if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
        return known
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo.parent.mkdir(exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


@contextmanager
def _lock(path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (none where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache whole
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_hf_dir(gguf_path: Path, out: Path, progress: Progress | None = None) -> None:
    """Write config.json, tokenizer files and model.safetensors for ``gguf_path`` into ``out``."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    say = progress or (lambda line: None)
    reader = GGUFReader(str(gguf_path))
    meta = {name: _value(f) for name, f in reader.fields.items()}
    tensors = _tensors(
        reader, meta, lambda layer, of: say(f"converting {gguf_path.name}: layer {layer}/{of}")
    )
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(meta), indent=2))
    (out / "config.json").write_text(json.dumps(_hf_config(meta, tensors), indent=2))
    size = sum(t.nbytes for t in tensors.values())
    say(f"{gguf_path.name}: writing model.safetensors ({size / 2**20:,.0f} MiB)")
    save_file(tensors, str(out / "model.safetensors"))


def _value(field: Any) -> Any:
    """A metadata field as a Python value (older gguf releases lack ``contents()``)."""
    if hasattr(field, "contents"):
        return field.contents()
    from gguf import GGUFValueType

    parts = [field.parts[i] for i in field.data]
    if field.types[-1] == GGUFValueType.STRING:
        strings = [bytes(p).decode("utf-8") for p in parts]
        return strings if field.types[0] == GGUFValueType.ARRAY else strings[0]
    values = [p.tolist()[0] for p in parts]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def _arch(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2")
    return arch


def _tensors(
    reader: Any, meta: dict[str, Any], on_layer: Callable[[int, int], None] | None = None
) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its HF name; ``on_layer(i, n)`` as layer i of
    n begins."""
    from gguf.quants import dequantize

    arch = _arch(meta)
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    layers = int(meta.get(f"{arch}.block_count", 0))
    out: dict[str, np.ndarray] = {}
    seen: set[str] = set()
    for t in reader.tensors:
        name = _hf_name(t.name)
        if on_layer and t.name.startswith("blk.") and (layer := t.name.split(".")[1]) not in seen:
            seen.add(layer)
            on_layer(len(seen), layers)
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if arch == "llama" and ".q_proj." in name:
            w = _unpermute(w, heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _unpermute(w, kv_heads)
        out[name] = w
    return out


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    blk, index, part, kind = name.split(".")
    if blk != "blk" or part not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{index}.{_LAYER_NAMES[part]}.{kind}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's interleaving of each head's two rotary halves."""
    rows = w.shape[0]
    split = w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(split.reshape(w.shape))


def _hf_config(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    arch = _arch(meta)

    def m(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(m("attention.head_count"))
    hidden = int(m("embedding_length"))
    config = {
        "model_type": arch,
        "vocab_size": int(m("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden,
        "intermediate_size": int(m("feed_forward_length")),
        "num_hidden_layers": int(m("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m("attention.head_count_kv", heads)),
        "head_dim": int(m("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m("context_length", 4096)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
    }
    if m("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(m("rope.scaling.factor"))}
    return config


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [meta.get(f"tokenizer.ggml.{k}") for k in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def text(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None else None

    return {
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": text("bos_token_id"),
        "eos_token": text("eos_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` equal to llama.cpp's for a gpt2-style (byte-level BPE) vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only gpt2-style BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    pre = meta.get("tokenizer.ggml.pre", "default")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama3")))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    special = [
        AddedToken(tokens[i], special=t == TOKEN_TYPE_CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_special_tokens(special)
    _add_bos_processor(tokenizer, meta, tokens)
    return tokenizer


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre in _SPLIT_REGEX:
        split = pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    return byte_level


def _add_bos_processor(tokenizer: Any, meta: dict[str, Any], tokens: list[str]) -> None:
    from tokenizers import processors

    bos = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token") or bos is None:
        return
    text = tokens[int(bos)]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{text} $A", pair=f"{text} $A {text} $B", special_tokens=[(text, int(bos))]
    )
