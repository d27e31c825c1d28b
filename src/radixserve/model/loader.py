"""Loading a model's weights (safetensors, one file or shards) as tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_weights(model_dir: Path, device: str = "cpu") -> dict[str, Any]:
    """All tensors of ``model.safetensors`` or of every shard named in its index."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    tensors: dict[str, Any] = {}
    for shard in shards:
        tensors.update(load_file(str(model_dir / shard), device=device))
    return tensors
