"""The scheduler's runs of pure decode steps taken at once (the simulator's fast path): how
long a run may be, booking it, and advancing every decode by its tokens. The run arithmetic
itself is sched/decode_run.py. Mixed into ``Scheduler``."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.sched.decode_run import RunEvictions, apply_run, run_length
from radixserve.sched.kv import KVManager
from radixserve.sched.request import ReqState
from radixserve.sched.running import RunningSet


class DecodeRuns:
    """decode_run_length / begin_decode_run / decode_run_begun / advance_decodes."""

    kv: KVManager
    running: RunningSet
    run_evictions: int

    # -- runs of pure decode steps (the simulator's fast path) -------------------------------
    def decode_run_length(self) -> int:
        """Pure decode steps ``step()`` would take next, one after another, if no request came
        in meanwhile: none retracts, and the last may finish requests (``advance_decodes``
        ends them; see ``decode_run``)."""
        if self._in_flight is not None or self._run is not None:
            return 0
        return run_length(self.running, len(self.policy), self.kv, self.eos_token_ids)

    def begin_decode_run(self, steps: int) -> None:
        """Book ``steps`` (at most ``decode_run_length()``) and begin the first: its eviction,
        if it makes one, is made now; ``decode_run_begun`` begins later ones."""
        if self.kv.allocator.available() >= len(self.running.decoding) * (steps + self.kv.page):
            return  # more free slots than any run of this length takes: it evicts nothing
        self._run = RunEvictions(self.running, self.kv, steps)
        self.run_evictions += self._run.begin(1)

    def decode_run_begun(self, steps: int) -> int | None:
        """The booked run's first ``steps`` steps have begun: the tree loses what they evict.
        Returns the next step that will evict (None: none)."""
        if self._run is None:  # a run that evicts nothing
            return None
        self.run_evictions += self._run.begin(steps)
        return self._run.next_step()

    def advance_decodes(self, tokens: Sequence[Sequence[int]]) -> list[str]:
        """Take ``len(tokens[0])`` decode steps at once (the booked run's first ones, if one
        is booked), as ``step()`` and ``on_output()`` would one by one; ``tokens[i]``: the
        next tokens of ``running.decoding``'s i-th request. Returns the requests the last
        step finished (ended, in batch order, as ``on_output`` ends them)."""
        if self._run is not None:
            self.run_evictions += self._run.begin(len(tokens[0]))
            self._run = None
        self._step_id += apply_run(self.running, self.kv, tokens)
        self._last_chunk = False
        done = [
            (req.rid, reason)
            for req in self.running.decoding.values()
            if (reason := self._stop_reason(req, req.output_ids[-1])) is not None
        ]
        for rid, reason in done:
            self._end(rid, ReqState.FINISHED, reason)
        return [rid for rid, _ in done]
