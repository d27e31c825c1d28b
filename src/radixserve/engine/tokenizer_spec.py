"""How a child process rebuilds the tokenizer: a small picklable description instead of the
tokenizer object itself (an HF model directory, or the simulated word tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.modelfiles.sim_tokenizer import SIM_VOCAB_SIZE


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    kind: str  # "hf" or "sim"
    model_dir: str | None = None
    context_length: int | None = None
    vocab_size: int = SIM_VOCAB_SIZE
    name: str | None = None  # the model's own (its GGUF file's or directory's), never model_dir's

    def load(self) -> Any:
        if self.kind == "sim":
            from radixserve.modelfiles.sim_tokenizer import SimTokenizer

            return SimTokenizer(self.vocab_size, self.context_length or 131072)
        from radixserve.modelfiles.tokenizer import load_model_info

        assert self.model_dir is not None
        return load_model_info(self.model_dir, self.context_length, self.name)
