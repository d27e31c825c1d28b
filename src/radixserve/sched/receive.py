"""The decode role's admission: whether a request whose prompt was computed elsewhere (a prefill
engine) may reserve slots here for the KV it will receive, and decode to its end.

Pure bookkeeping over the KV manager; the scheduler owns the requests (``Scheduler.reserve``).
"""

# A decode engine never retracts: a retracted request goes back to the waiting queue and is
# prefilled again, which is the work disaggregation moves off decode engines. So a request is
# admitted only when the pool (free + evictable) holds, besides what it receives, every token
# it and each request already here may still decode up to max_new_tokens, in whole pages.
# SGLang's decode side reserves a fixed number of tokens per request and retracts when that
# falls short; reserving the whole generation admits fewer requests when max_new_tokens is
# far above what they produce, but a decode step is then never taken over by a prefill.

from __future__ import annotations

from collections.abc import Iterable

from radixserve.sched.kv import KVManager
from radixserve.sched.request import Req


def final_len(req: Req) -> int:
    """Slots ``req`` holds when it ends: the prompt plus every new token but the last."""
    return len(req.input_ids) + req.sampling.max_new_tokens - 1


def still_needed(kv: KVManager, req: Req) -> int:
    """Slots a request here (reserved or decoding, ``kv_len`` computed or received) may still
    take before it ends."""
    return kv.extend_cost(req, max(final_len(req) - req.kv_len, 0))


def fits(kv: KVManager, here: Iterable[Req], req: Req) -> bool:
    """``req`` (no slots yet) can receive its prompt and decode to its end, beside ``here``."""
    own = kv.allocator.pages_for(final_len(req)) * kv.page
    return kv.room() >= own + sum(still_needed(kv, r) for r in here)
