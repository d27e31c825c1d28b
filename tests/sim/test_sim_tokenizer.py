"""SimTokenizer, the word tokenizer of `serve --sim`: rendered ids come back exactly, and no text
ever encodes to an id outside the vocabulary."""

from __future__ import annotations

import random

from radixserve.modelfiles.sim_tokenizer import SimTokenizer
from radixserve.sim.workloads import render_text


def test_rendered_ids_come_back_exactly() -> None:
    tok = SimTokenizer(vocab_size=32000)
    ids = [0, 1, 63, 64, 4095, 31998, 31999]
    assert tok.encode(render_text(ids)) == ids


def test_random_text_stays_in_the_vocabulary() -> None:
    # words of these letters often read as syllable strings: "hide" = 2070, "deadhead" much more
    rng = random.Random(0)
    for vocab in (100, 32000):
        tok = SimTokenizer(vocab_size=vocab)
        for _ in range(500):
            text = "".join(rng.choice("abcdefghij ") for _ in range(60))
            assert all(0 <= i < vocab for i in tok.encode(text)), text
    assert SimTokenizer(100).encode("hide") == SimTokenizer(100).encode("hide")  # stable
