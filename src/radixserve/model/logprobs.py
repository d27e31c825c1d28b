"""Log-probabilities for the requests that ask for them: of each sampled token, and of prompt
tokens as the prefill computes them. Values are the model's own distribution (log-softmax of
the raw logits, before penalties, bias, grammar or temperature), as vLLM returns by default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from radixserve.sched.batch import BatchEntry, EntryLogprobs, TokenLogprob


def _rows(logprobs: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """(token, its logprob, top k) per row of ``logprobs`` ``[R, vocab]``."""
    picked = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0]
    top_v, top_i = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    out = []
    for t, v, ids, vals in zip(tokens, picked.tolist(), top_i.tolist(), top_v.tolist()):
        out.append((int(t), v, tuple(zip(map(int, ids), vals))))
    return out


def sampled_logprobs(
    logits: torch.Tensor, entries: Sequence[BatchEntry], tokens: Sequence[int]
) -> dict[int, EntryLogprobs]:
    """For each entry ``k`` with ``return_logprob``: the logprob of ``tokens[k]`` under row
    ``k`` of the raw ``logits``, and its top ``top_logprobs_num`` alternatives."""
    want = [k for k, e in enumerate(entries) if e.sampling.return_logprob]
    if not want:
        return {}
    index = torch.tensor(want, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    out = {}
    for j, k in enumerate(want):
        row = _rows(lp[j : j + 1], [tokens[k]], entries[k].sampling.top_logprobs_num)
        out[k] = EntryLogprobs(sampled=row[0])
    return out


def prompt_span(e: BatchEntry) -> range:
    """Prompt positions whose logprob this prefill entry computes: a row at position ``p``
    predicts the token at ``p + 1``. A re-prefill after a retraction (output already out)
    reported its prompt before, and position 0 has no logprob."""
    sp = e.sampling
    if not (e.is_prefill and sp.prompt_logprobs) or e.num_generated:
        return range(0)
    first = max(e.start_pos + 1, sp.logprob_start_len, 1)
    return range(first, min(e.seq_len, len(e.prompt_ids) - 1) + 1)


def prompt_logprobs(
    hidden: torch.Tensor,
    first_rows: Sequence[int],
    entries: Sequence[BatchEntry],
    project: Callable[[torch.Tensor], torch.Tensor],
) -> dict[int, EntryLogprobs]:
    """Prompt logprobs of every prefill entry that asks for them; ``first_rows[i]`` is entry
    ``i``'s first row in ``hidden``, ``project`` turns hidden rows into logits."""
    out = {}
    for i, e in enumerate(entries):
        span = prompt_span(e)
        if not span:
            continue
        rows = torch.arange(span.start - 1, span.stop - 1) - e.start_pos + first_rows[i]
        logits = project(hidden.index_select(0, rows.to(hidden.device)))
        lp = torch.log_softmax(logits.float(), dim=-1)
        tokens = [e.prompt_ids[p] for p in span]
        out[i] = EntryLogprobs(None, span.start, _rows(lp, tokens, e.sampling.top_logprobs_num))
    return out
