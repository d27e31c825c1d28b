"""The scheduler's decode entries of a step and the KV they and a prompt chunk need, and
retraction: running requests sent back to the queue when the pool cannot hold them all.
Mixed into ``Scheduler``."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.config import SchedulerConfig
from radixserve.sched.batch import BatchEntry
from radixserve.sched.kv import KVManager
from radixserve.sched.request import Req, ReqState
from radixserve.sched.running import RunningSet, retract_order


class Retraction:
    """Decode batch entries, their KV need, and retracting requests to meet it."""

    config: SchedulerConfig
    kv: KVManager
    running: RunningSet

    # -- decode and retraction ---------------------------------------------------------------
    def _decode_entries(self) -> list[BatchEntry]:
        decoding = self.running.decoding
        if not decoding:
            return []
        kv = self.kv
        chunk = self._chunk_need() if self.config.enable_mixed_chunk else 0
        if not kv.covers(len(decoding), chunk):
            spare = max(decoding.values(), key=retract_order)
            self._retract_until(lambda: kv.ensure_free(self._decode_need()), spare)
        # the decodes' slots are free now (nothing more to evict): one extend each, no checks
        table = kv.table
        entries = []
        for rid, req in decoding.items():
            table.extend(rid, 1)
            entries.append(
                BatchEntry(
                    rid,
                    [req.output_ids[-1]],
                    req.kv_len,
                    table.slots(rid),
                    True,
                    req.sampling,
                    False,
                    len(req.output_ids),
                    req.input_ids,
                    req.output_ids,
                )
            )
        self.running.decay()
        return entries

    def _decode_need(self) -> int:
        need = sum(self.kv.extend_cost(r, 1) for r in self.running.decoding.values())
        return need + self._chunk_need() if self.config.enable_mixed_chunk else need

    def _chunk_need(self) -> int:
        req = self.running.chunked
        if req is None:
            return 0
        cfg = self.config
        cap = max(min(cfg.max_prefill_tokens, cfg.chunked_prefill_size), self.kv.page)
        return self.kv.extend_cost(req, min(req.fill_len - req.kv_len, cap))

    def _make_room_for_chunk(self) -> None:
        if self.running.chunked is not None:
            need = self._chunk_need()
            self._retract_until(lambda: self.kv.room() >= need, self.running.chunked)

    def _retract_until(self, fits: Callable[[], bool], spare: Req) -> None:
        """Retract running requests, fewest generated tokens first, until ``fits()``."""
        for req in self.running.retraction_order():
            if fits():
                return
            if req is not spare:
                self._retract(req)
        if not fits():
            raise RuntimeError("KV accounting error: one request alone does not fit the pool")

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue. Its computed KV goes to the tree (it
        resumes from there unless evicted meanwhile) and its output so far is kept, so it
        later finishes with exactly the output it would have had."""
        self.running.leave(req)
        self.kv.release(req, keep=True)
        req.state, req.kv_len = ReqState.WAITING, 0
        req.num_retractions += 1
        req.queued_at = self.clock()
        self._n["retracted"] += 1
        self._enqueue(req)
        self.running.on_retract()
