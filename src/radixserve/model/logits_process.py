"""What a request's sampling parameters do to its logits before a token is drawn: repetition,
frequency and presence penalties, logit bias, and holding EOS and stop tokens back until
``min_new_tokens``. Each is vectorised over the rows that use it.

Semantics are vLLM's (and SGLang's): frequency and presence penalties count the output tokens
only; the repetition penalty covers every token seen (prompt and output) and divides a positive
logit by the penalty, multiplies a negative one. The counts are rebuilt each step from the
request's own token lists, so they are right after chunked prefill, a prefix-cache hit or a
retraction without any state to keep in sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.sched.batch import BatchEntry


def process_logits(
    logits: torch.Tensor, entries: Sequence[BatchEntry], eos_ids: Sequence[int]
) -> torch.Tensor:
    """Apply every entry's processors to its row of ``logits`` ``[N, vocab]`` (in place)."""
    _penalize(logits, entries)
    _bias(logits, entries)
    _hold_back_stops(logits, entries, eos_ids)
    return logits


def _counts(lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(lists), vocab]``: how often each token id occurs in each list."""
    counts = torch.zeros(len(lists), vocab, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(lists)), lengths).to(device)
    ids = torch.tensor([t for x in lists for t in x], dtype=torch.int64, device=device)
    keep = ids < vocab
    counts.index_put_((row[keep], ids[keep]), torch.ones_like(ids[keep], dtype=counts.dtype),
                      accumulate=True)  # fmt: skip
    return counts


def _penalize(logits: torch.Tensor, entries: Sequence[BatchEntry]) -> None:
    rows = [i for i, e in enumerate(entries) if e.sampling.penalized]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    picked = [entries[i] for i in rows]
    index = torch.tensor(rows, device=device)
    sub = logits[index]
    out = _counts([e.output_ids for e in picked], vocab, device)

    def column(name: str) -> torch.Tensor:
        values = [getattr(e.sampling, name) for e in picked]
        return torch.tensor(values, dtype=sub.dtype, device=device)[:, None]

    rep = column("repetition_penalty")
    seen = (out > 0) | (_counts([e.prompt_ids for e in picked], vocab, device) > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= column("frequency_penalty") * out + column("presence_penalty") * (out > 0)
    logits[index] = sub


def _bias(logits: torch.Tensor, entries: Sequence[BatchEntry]) -> None:
    rows = [i for i, e in enumerate(entries) if e.sampling.logit_bias]
    if not rows:
        return
    vocab = logits.shape[-1]
    pairs = [(i, t, b) for i in rows for t, b in entries[i].sampling.logit_bias if t < vocab]
    if not pairs:
        return
    row, tok, bias = (torch.tensor(x, device=logits.device) for x in zip(*pairs, strict=True))
    logits.index_put_((row, tok), bias.to(logits.dtype), accumulate=True)
    # OpenAI: -100 bans the token (an added -100 alone leaves it drawable when all else is low)
    banned = bias <= -100
    logits[row[banned], tok[banned]] = float("-inf")


def _hold_back_stops(
    logits: torch.Tensor, entries: Sequence[BatchEntry], eos_ids: Sequence[int]
) -> None:
    """Before ``min_new_tokens`` tokens exist, EOS and stop tokens cannot be drawn. A request
    with a grammar is left to its grammar, which alone knows when its output may end."""
    for i, e in enumerate(entries):
        sp = e.sampling
        if e.num_generated >= sp.min_new_tokens or sp.grammar is not None:
            continue
        banned = [*sp.stop_token_ids, *(() if sp.ignore_eos else eos_ids)]
        banned = [t for t in banned if t < logits.shape[-1]]
        if banned:
            logits[i, banned] = float("-inf")
