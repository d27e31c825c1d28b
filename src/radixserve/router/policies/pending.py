"""The prefill tokens each worker has yet to compute, as a router knows them: its own dispatches
and the worker's reports of its waiting prefill. Pure (no I/O, no clock): kv_aware's queue term."""

# A worker's report (WorkerView.prefill_tokens, asked for at reported_at) replaces every
# dispatch made up to that moment; later dispatches add to it until they complete. The report
# stays until the next one, but the requests it counted may finish before then: a request this
# router sent before the report and that completed after it is no longer waiting, so its tokens
# leave the report's count (never below 0: the report also counts other clients' requests, and
# one that was already being computed when the report was asked was not in it). Without this a
# report asked while one request waited held its tokens against an idle worker until the next
# poll, and every new prefix in between went to the other workers (tests/router/indexer/
# test_kv_redis_fleet.py saw 8 new prompts sent one after another all go to one of two).

from __future__ import annotations

from collections.abc import Hashable

from radixserve.router.policies.base import WorkerView

_Sent = tuple[float, int]  # (dispatched at, uncached tokens)
_Done = tuple[float, float, int]  # (dispatched at, completed at, uncached tokens)


class PendingPrefill:
    """Per worker: the dispatches not completed, and the completed ones that a report asked
    for before they completed may still count (keyed by request: any hashable)."""

    def __init__(self) -> None:
        self._sent: dict[Hashable, dict[Hashable, _Sent]] = {}
        self._done: dict[Hashable, list[_Done]] = {}

    def add(self, worker: Hashable, request: Hashable, now: float, tokens: int) -> None:
        self._sent.setdefault(worker, {})[request] = (now, tokens)

    def complete(self, worker: Hashable, request: Hashable, now: float) -> None:
        sent = self._sent.get(worker)
        rec = None if sent is None else sent.pop(request, None)
        if rec is not None:
            self._done.setdefault(worker, []).append((rec[0], now, rec[1]))

    def forget(self, worker: Hashable) -> None:
        self._sent.pop(worker, None)
        self._done.pop(worker, None)

    def reconcile(self, worker: WorkerView) -> None:
        """Drop the completions that ``worker``'s report already reflects (all of them while
        it reports nothing)."""
        done = self._done.get(worker.id)
        if done:
            at = worker.reported_at if worker.prefill_tokens is not None else float("inf")
            done[:] = [d for d in done if d[1] > at]

    def tokens(self, worker: WorkerView) -> int:
        """Prefill tokens ``worker`` has yet to compute, as far as the router knows."""
        sent = self._sent.get(worker.id, {}).values()
        if worker.prefill_tokens is None:
            return sum(n for _, n in sent)
        at = worker.reported_at
        later = sum(n for t, n in sent if t > at)  # not in the report
        gone = sum(n for t0, t1, n in self._done.get(worker.id, ()) if t0 <= at < t1)
        return later + max(0, worker.prefill_tokens - gone)
