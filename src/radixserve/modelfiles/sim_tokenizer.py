"""A tokenizer for simulated engines: one whitespace-separated word per token id, and the word
rendering of token ids that simulated workloads use. Low in the layers (no import of sim/): the
engine, the server, the router and the simulator all read it.

Words written by ``render_text`` map back to their ids; any other word, and a word
that reads as a rendered id outside the vocabulary, maps to a stable hash in range, so HTTP
clients can send ordinary text to a ``serve --sim`` worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

SIM_VOCAB_SIZE = 32000
"""Token ids of simulated workloads and of the simulated tokenizer are in [0, SIM_VOCAB_SIZE)."""

_SYLLABLES = [c + v for c in "bcdfghjklmnprstv" for v in "aeio"]
_SYLLABLE_INDEX = {s: i for i, s in enumerate(_SYLLABLES)}


def render_text(input_ids: Iterable[int]) -> str:
    """One word per token id, space separated; equal id prefixes give equal text prefixes."""
    return " ".join(_word(i) for i in input_ids)


def parse_text(text: str) -> list[int]:
    """The token ids that ``render_text`` wrote."""
    return [_word_id(w) for w in text.split()]


def _word(token_id: int) -> str:
    if token_id < 0:
        raise ValueError(f"token ids must be >= 0, got {token_id}")
    digits = []
    while True:
        token_id, d = divmod(token_id, 64)
        digits.append(_SYLLABLES[d])
        if token_id == 0:
            return "".join(reversed(digits))


def _word_id(word: str) -> int:
    if len(word) % 2:
        raise ValueError(f"not a rendered token: {word!r}")
    value = 0
    for k in range(0, len(word), 2):
        digit = _SYLLABLE_INDEX.get(word[k : k + 2])
        if digit is None:
            raise ValueError(f"not a rendered token: {word!r}")
        value = value * 64 + digit
    return value


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
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,  # no template: its variables have nowhere to go
    ) -> str:
        text = " ".join(f"{m.get('role', 'user')}: {m.get('content') or ''}" for m in messages)
        return text + (" assistant:" if add_generation_prompt else "")
