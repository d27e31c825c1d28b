"""A tokenizer for simulated engines: one whitespace-separated word per token id.

Words written by ``workloads.render_text`` map back to their ids; any other word, and a word
that reads as a rendered id outside the vocabulary, maps to a stable hash in range, so HTTP
clients can send ordinary text to a ``serve --sim`` worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from radixserve.sim.workloads import SIM_VOCAB_SIZE, parse_text, render_text


class SimTokenizer:
    """The ModelInfo interface (encode, decode, chat template, special ids) without a model."""

    def __init__(self, vocab_size: int = SIM_VOCAB_SIZE, context_length: int = 131072) -> None:
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.eos_token_ids: tuple[int, ...] = (vocab_size - 1,)
        self.bos_token_id: int | None = None
        self.chat_template = "sim"
        self.name = "sim"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self._word_id(w) for w in text.split()]

    def fingerprint(self) -> str:
        """See ModelInfo.fingerprint: the word tokenizer depends on its vocabulary size only."""
        return f"sim:{self.vocab_size}"

    def _word_id(self, word: str) -> int:
        try:
            token = parse_text(word)[0]
        except (ValueError, KeyError, IndexError):
            token = self.vocab_size
        if token < self.vocab_size:
            return token
        # ordinary words often read as long syllable strings ("hide" = hi + de): an id past
        # the vocabulary would make the engine refuse the whole prompt
        return xxhash.xxh64_intdigest(word.encode()) % (self.vocab_size - 1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.eos_token_ids]
        return (" " + render_text(ids)) if ids else ""

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        text = " ".join(f"{m.get('role', 'user')}: {m.get('content') or ''}" for m in messages)
        return text + (" assistant:" if add_generation_prompt else "")
