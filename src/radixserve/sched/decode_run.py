"""Runs of pure decode steps applied at once: how many steps from here can change nothing but
the decoding requests' KV and outputs, and applying them exactly as one step at a time would.

A discrete-event simulator spends most of its time on single-token decode steps of long
outputs; when nothing else can happen between them it advances a whole run in one event.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.sched.kv import KVManager
from radixserve.sched.running import RunningSet


def run_length(
    running: RunningSet, num_waiting: int, kv: KVManager, eos_token_ids: frozenset[int]
) -> int:
    """Decode steps that ``step()`` would take back to back, each on the same requests, with
    no request finishing (the step that finishes one is left to ``step()``) and without
    eviction or retraction. 0 when anything else is waiting, being prefilled or may stop
    early (a stop token, or EOS without ``ignore_eos``)."""
    if running.chunked is not None or num_waiting or not running.decoding:
        return 0
    left = None
    for req in running.decoding.values():
        sp = req.sampling
        if sp.stop_token_ids or (eos_token_ids and not sp.ignore_eos):
            return 0
        n = sp.max_new_tokens - len(req.output_ids)
        left = n if left is None or n < left else left
    # a step decodes without evicting while the free slots hold a fresh page per request
    # (KVManager.covers); a request takes at most one page per `page` steps, so with q pages
    # per request free, the first (q - 1) * page + 1 steps all pass that check
    page = kv.page
    q = kv.allocator.available() // (len(running.decoding) * page)
    return max(0, min(left - 1, (q - 1) * page + 1))  # type: ignore[operator]


def apply_run(running: RunningSet, kv: KVManager, tokens: Sequence[Sequence[int]]) -> int:
    """Apply ``len(tokens[0])`` decode steps: ``tokens[i]`` are the next tokens of the i-th
    decoding request (``running.decoding`` order). Returns the number of steps."""
    steps = len(tokens[0])
    table = kv.table
    for (rid, req), toks in zip(running.decoding.items(), tokens, strict=True):
        if len(toks) != steps:
            raise ValueError("every decoding request needs the same number of tokens")
        table.extend(rid, steps)
        req.kv_len += steps
        req.output_ids.extend(toks)
    running.decay(steps)
    return steps
