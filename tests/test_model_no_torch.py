"""The model package's tokenizer, loader and Runner protocol work where torch is missing: the API
process tokenizes with them, and the simulator names the Runner protocol."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("tokenizers")

TORCH_FREE = [
    "radixserve.model",
    "radixserve.model.protocol",
    "radixserve.model.tokenizer",
    "radixserve.model.loader",
    "radixserve.model.gguf_loader",
]

BLOCK_TORCH = """
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
for mod in sys.argv[1:]:
    importlib.import_module(mod)
assert "torch" not in sys.modules
print("ok")
"""


def test_tokenizer_loader_and_protocol_import_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, *TORCH_FREE], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_runner_protocol_is_structural() -> None:
    from radixserve.model.protocol import Runner
    from radixserve.sched.batch import Batch, StepResult

    class Echo:
        def run(self, batch: Batch) -> StepResult:
            return StepResult([None for _ in batch.entries])

    assert isinstance(Echo(), Runner)
    assert not isinstance(object(), Runner)
