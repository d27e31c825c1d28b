"""Token ids for a trace's hash ids: inside a vocabulary, with prefixes shared exactly as the
hash ids share them (trace replay for the simulator and for `radixserve bench`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

TRACE_BLOCK_TOKENS = 512  # Mooncake's traces hash prompts in blocks of 512 tokens


class TraceTokens:
    """Token ids for a trace's blocks, all in ``[0, vocab_size - 1)`` (the last id is the
    simulated engines' EOS), so that any engine accepts them, yet prefix sharing is exact.

    A block's first token is its index among the blocks seen after the same parent block
    (hash ids are prefix-chained: a block's id fixes its parent); the rest of the block is
    filler. Blocks that follow a common prefix thus differ at their first token, and two
    prompts share exactly the tokens of their shared leading blocks, as the trace implies.
    More distinct blocks after one parent than the vocabulary allows is an error."""

    def __init__(self, block_tokens: int, vocab_size: int) -> None:
        self.block_tokens, self.vocab = block_tokens, vocab_size - 1
        self._blocks: dict[int, list[int]] = {}  # shared: equal blocks share their int objects
        self._children: dict[int | None, int] = {}  # parent hash id -> blocks seen after it

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> list[int]:
        """The token ids of a trace prompt (``input_length`` tokens at 512 a block)."""
        ids: list[int] = []
        parent = None
        for h in hash_ids:
            block = self._blocks.get(h)
            if block is None:
                block = self._blocks[h] = self._new_block(h, parent)
            ids += block
            parent = h
        last = input_length - TRACE_BLOCK_TOKENS * (len(hash_ids) - 1)
        last = math.ceil(last * self.block_tokens / TRACE_BLOCK_TOKENS)
        del ids[len(ids) - self.block_tokens + last :]
        return ids

    def _new_block(self, h: int, parent: int | None) -> list[int]:
        first = self._children.get(parent, 0)
        if first >= self.vocab:
            raise ValueError(
                f"more than {self.vocab} distinct blocks follow hash id {parent}: "
                "raise --vocab-size to keep their prefixes apart"
            )
        self._children[parent] = first + 1
        base = h * TRACE_BLOCK_TOKENS
        return [first] + [(base + k) % self.vocab for k in range(1, self.block_tokens)]
