"""The engine's spans of one finished request (--enable-trace): queue wait, prefill and decode,
under the HTTP request's span, built from the timestamps the scheduler keeps on each Req
(sched/ only records times; OpenTelemetry is used here, in the engine layer)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from radixserve.sched.request import Req


def record_request(tracer: Any, parent: str, req: Req, clock: Callable[[], float]) -> None:
    """Record `req`'s spans under the traceparent `parent`; `clock` is the scheduler's (its
    timestamps are on it: each is moved onto the wall clock the spans are stamped with)."""
    offset = time.time_ns() - int(clock() * 1e9)

    def ns(t: float) -> int:
        return int(t * 1e9) + offset

    arrival, scheduled = req.arrival_time, req.first_scheduled_time
    if arrival is None or scheduled is None:  # never ran: no spans but the server's
        return
    prompt = len(req.input_ids)
    tracer.record("radixserve.engine.queue", parent, ns(arrival), ns(scheduled),
                  {"radixserve.prompt_tokens": prompt,
                   "radixserve.priority": req.priority})  # fmt: skip
    first, end = req.first_token_time, req.finish_time
    if first is None:
        return
    tracer.record("radixserve.engine.prefill", parent, ns(scheduled), ns(first), {
        "radixserve.prompt_tokens": prompt, "radixserve.cached_tokens": req.cached_tokens,
        "radixserve.host_cached_tokens": req.host_cached_tokens,
        "radixserve.computed_tokens": prompt - req.cached_tokens,
        "radixserve.retractions": req.num_retractions,
    })  # fmt: skip
    if end is not None:
        reason = req.finish_reason.value if req.finish_reason is not None else ""
        tracer.record("radixserve.engine.decode", parent, ns(first), ns(end),
                      {"radixserve.output_tokens": req.num_generated,
                       "radixserve.finish_reason": reason})  # fmt: skip
