"""A deterministic runner with a fake KV pool, a virtual clock and a driver for scheduler tests.

The runner reads every context through the batch's slot ids, so a wrong or stale slot gives a
wrong token: output equality with ``reference()`` proves the KV bookkeeping right.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Iterable

from radixserve.sched.batch import Batch, BatchEntry, StepResult
from radixserve.sched.request import Req, ReqState, SamplingParams
from radixserve.sched.scheduler import Scheduler

VOCAB = 1009


def next_token(ctx_sum: int, last3: Iterable[int], n: int) -> int:
    """The token after a context of ``n`` tokens summing to ``ctx_sum``, ending in ``last3``."""
    return (sum(last3) * 31 + ctx_sum * 7 + n) % VOCAB


def reference(prompt: list[int], max_new: int, stop: Iterable[int] = ()) -> list[int]:
    """What a correct engine outputs for ``prompt`` (greedy, stops after a stop token)."""
    ctx, total, out, stops = list(prompt), sum(prompt), [], set(stop)
    while len(out) < max_new:
        tok = next_token(total, ctx[-3:], len(ctx))
        out.append(tok)
        ctx.append(tok)
        total += tok
        if tok in stops:
            break
    return out


def assert_match_reference(reqs: Iterable[Req], stop: Iterable[int] = ()) -> None:
    """Every finished request output what ``reference()`` does; an aborted one a prefix of it."""
    stop = tuple(stop)
    for r in reqs:
        ref = reference(r.input_ids, r.sampling.max_new_tokens, stop=stop)
        if r.state is ReqState.ABORTED:
            assert r.output_ids == ref[: len(r.output_ids)], r.rid
        else:
            assert r.output_ids == ref, r.rid


class KVRunner:
    """Writes each computed token and its position into the slot it is given, and computes
    the next token from the context read back through the entry's slots."""

    def __init__(self, num_slots: int) -> None:
        self.tok: list[int | None] = [None] * num_slots
        self.pos: list[int | None] = [None] * num_slots
        self.prefill_tokens = 0  # tokens computed by prefill entries (cache misses)

    def _read(self, table: list[int | None], slots: list[int]) -> tuple:
        got = operator.itemgetter(*slots)(table)
        return got if len(slots) > 1 else (got,)

    def run(self, batch: Batch) -> StepResult:
        out: list[int | None] = []
        for e in batch.entries:
            for i, t in enumerate(e.token_ids):
                self.tok[e.slots[e.start_pos + i]] = t
                self.pos[e.slots[e.start_pos + i]] = e.start_pos + i
            if e.is_prefill:
                self.prefill_tokens += len(e.token_ids)
            slots = e.slots[: e.seq_len]
            assert len(e.slots) == e.seq_len, "entry slots must cover exactly its sequence"
            assert self._read(self.pos, slots) == tuple(range(e.seq_len)), "slot of wrong position"
            ctx = self._read(self.tok, slots)
            out.append(next_token(sum(ctx), ctx[-3:], len(ctx)) if e.sample else None)
        return StepResult(out)


class Clock:
    """A virtual clock the driver advances by each step's modelled cost."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def step_cost(batch: Batch, fixed: float = 0.005, per_token: float = 0.0001) -> float:
    return fixed + per_token * batch.num_tokens


def drive(
    sched: Scheduler,
    runner: KVRunner,
    clock: Clock | None = None,
    arrivals: list[tuple[float, Req]] | None = None,
    max_steps: int = 100_000,
    on_step: Callable[[Scheduler], None] | None = None,
) -> dict[str, list[int]]:
    """Run until idle with no arrivals left; returns each request's output tokens. Arrivals
    (time, request) are added when the clock reaches them; integrity is checked every step."""
    pending = sorted(arrivals or [], key=lambda a: a[0])
    outs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        while pending and (clock is None or pending[0][0] <= clock.t):
            sched.add_request(pending.pop(0)[1])
        batch = sched.step()
        sched.check_integrity()
        if batch is None:
            if not pending:
                return outs
            assert clock is not None
            clock.t = pending[0][0]
            continue
        for o in sched.on_output(batch, runner.run(batch)):
            outs.setdefault(o.rid, []).append(o.token_id)
        if clock is not None:
            clock.t += step_cost(batch)
        sched.check_integrity()
        if on_step is not None:
            on_step(sched)
    raise AssertionError("the scheduler did not go idle")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def make_req(rid: str, prompt: list[int], max_new: int = 8, **kw: object) -> Req:
    stop = kw.pop("stop_token_ids", ())
    ignore_eos = bool(kw.pop("ignore_eos", False))
    sampling = SamplingParams(max_new_tokens=max_new, stop_token_ids=stop, ignore_eos=ignore_eos)  # type: ignore[arg-type]
    return Req(rid, prompt, sampling, **kw)  # type: ignore[arg-type]


def test_runner_matches_reference_without_a_scheduler() -> None:
    rng = random.Random(1)
    prompt = tokens(rng, 50)
    runner, out = KVRunner(100), []
    ctx = list(prompt)
    for _ in range(5):
        start = len(ctx) - 1 if out else 0
        e = BatchEntry(
            "r", ctx[start:], start, list(range(len(ctx))), True, SamplingParams(), not out
        )
        tok = runner.run(Batch([e])).next_token_ids[0]
        assert tok is not None
        out.append(tok)
        ctx.append(tok)
    assert out == reference(prompt, 5)
