"""ClusterSim's engine stepping, mixed into it: one step at a time, or a booked run of pure
decode steps (timed a chunk at a time, its evictions made as its steps begin, cut short when a
request comes in), and what a finished step or run hands back to the scheduler."""

from __future__ import annotations

import bisect
import heapq
from functools import reduce
from itertools import accumulate
from operator import add

from radixserve.sim.engine_state import _DONE, RUN_CHUNK, _DecodeRun, _Engine


class EngineSteps:
    """ClusterSim's stepping methods (state lives on ClusterSim)."""

    def _step(self, eng: _Engine) -> None:
        if eng.landed:
            self._apply_landed(eng)
        if self.config.decode_runs:
            steps = eng.sched.decode_run_length()
            if steps > 1:
                self._start_run(eng, steps)
                return
        ready = self._refetch(eng) if self.store is not None and eng.sched.num_waiting else 0.0
        batch = eng.sched.step()
        if batch is None:
            eng.awake = False
            return
        result = eng.runner.run(batch)
        eng.batch, eng.result = batch, result
        duration = result.duration or 0.0
        if ready > self.now:  # the step's forward starts once its refetched prefixes are in
            duration += ready - self.now
            result.duration = duration
        load = eng.load
        load.busy_s += duration
        load.steps += 1
        self._seq += 1
        heapq.heappush(self._events, (self.now + duration, _DONE, self._seq, eng.idx))

    def _start_run(self, eng: _Engine, steps: int) -> None:
        contexts = [r.kv_len for r in eng.sched.running.decoding.values()]
        self._seq += 1  # the run's end: ordered among the events as if pushed now
        run = eng.run = _DecodeRun([], [], self._seq, steps, contexts)
        self._time_steps(eng, run, RUN_CHUNK)
        self._book_chunk(eng, run)
        self.run_counts["runs"] += 1
        eng.sched.begin_decode_run(steps)  # the first step's eviction: now, as step() makes it
        self._next_eviction(eng, eng.sched.decode_run_begun(1))

    def _time_steps(self, eng: _Engine, run: _DecodeRun, upto: int) -> None:
        """Time the run's steps up to the ``upto``-th (at most the booked ones)."""
        have = len(run.durations)
        upto = min(upto, run.steps)
        if upto <= have:
            return
        contexts = [c + have for c in run.contexts] if have else run.contexts
        durations = eng.runner.decode_durations(contexts, upto - have)
        # each step's end: the last one's plus its duration, as event by event (in C)
        ends = list(accumulate(durations, initial=run.ends[-1] if have else self.now))
        del ends[0]
        run.durations += durations
        run.ends += ends

    def _book_chunk(self, eng: _Engine, run: _DecodeRun) -> None:
        """Queue the event at the last timed step's end: the run's DONE once every booked step
        is timed, else a chunk's end, which times more."""
        if len(run.ends) == run.steps:
            run.pending = run.seq
        else:
            self._seq += 1
            run.pending = self._seq
        heapq.heappush(self._events, (run.ends[-1], _DONE, run.pending, eng.idx))

    def _next_eviction(self, eng: _Engine, step: int | None) -> None:
        """Note when ``eng``'s run next evicts: the start of its ``step``-th step."""
        run = eng.run
        if step is None or run is None or step > run.steps:
            self._evicting.pop(eng.idx, None)
        else:
            self._time_steps(eng, run, step - 1)
            self._evicting[eng.idx] = run.ends[step - 2]  # step 1 began with the run

    def _begin_steps(self) -> None:
        """Before the trees of the engines in runs are read (a dispatch by the router's KV
        index): make the evictions of the steps that have begun by now."""
        for idx in list(self._evicting):
            self._begin_steps_of(self.engines[idx])

    def _begin_steps_of(self, eng: _Engine) -> None:
        """Before ``eng``'s tree is read (the request dispatched to it is matched there, or a
        store lookup's match): make the evictions of its run's steps begun by now. A tree no
        one reads can wait: nothing else touches it until the run ends, which makes them."""
        at = self._evicting.get(eng.idx)
        if at is not None and at < self.now:  # at equal times a step's start comes later
            begun = bisect.bisect_left(eng.run.ends, self.now) + 1  # type: ignore[union-attr]
            self._next_eviction(eng, eng.sched.decode_run_begun(begun))

    def _cut(self, eng: _Engine, run: _DecodeRun) -> None:
        """A request came in during a run: it ends with the step in flight (the first one
        ending at or after now; at equal times arrivals come before step completions)."""
        keep = bisect.bisect_left(run.ends, self.now) + 1  # the timed steps reach now
        if keep < run.steps:
            del run.durations[keep:], run.ends[keep:]
            run.steps = keep
            self._stale.add(run.pending)
            self._seq += 1
            run.seq = run.pending = self._seq
            heapq.heappush(self._events, (run.ends[-1], _DONE, self._seq, eng.idx))
            self.run_counts["cuts"] += 1

    def _finish_run(self, eng: _Engine, run: _DecodeRun) -> None:
        eng.run = None
        self._evicting.pop(eng.idx, None)
        load, steps = eng.load, len(run.durations)
        load.busy_s = reduce(add, run.durations, load.busy_s)  # in step order, as single steps
        load.steps += steps
        reqs = eng.sched.running.decoding.values()
        lasts = [r.output_ids[-1] for r in reqs]
        tokens = eng.runner.decode_tokens(lasts, [r.kv_len for r in reqs], steps)
        self.tbt.run(list(eng.sched.running.decoding), run.ends)
        done = eng.sched.advance_decodes(tokens)
        self.run_counts["steps"] += steps
        for rid in done:  # the run's last step finished them, as on_output would
            self._finish(rid)
        if done:
            self._bar.update(len(done))
        self._step(eng)

    def _complete(self, eng: _Engine, seq: int) -> None:
        run = eng.run
        if run is not None:
            if seq == run.seq:
                self._finish_run(eng, run)
            else:  # a chunk's end: time the next chunk, twice as long
                self._time_steps(eng, run, 2 * len(run.ends))
                self._book_chunk(eng, run)
            return
        batch, result = eng.batch, eng.result
        eng.batch = eng.result = None
        if self.store is not None:  # prompts computed whole by this step: written through
            for e in batch.entries:  # type: ignore[union-attr]
                if e.is_prefill and e.sample and e.num_generated == 0:
                    self._write_store(e.rid, e.prompt_ids)  # type: ignore[arg-type]
        done = 0
        outs = eng.sched.on_output(batch, result)  # type: ignore[arg-type]
        self.tbt.tokens(outs, self.now)
        for out in outs:
            if out.finished:
                self._finish(out.rid)
                done += 1
        if done:
            self._bar.update(done)
        self._step(eng)
