"""Cost of one scheduling pass (``Scheduler.step()``) over 128, 1,000 and 10,000 waiting requests,
and of a pass and a decode step at 10,000 waiting / 256 running against the prompt length.

Prompts are 2,000 tokens: a third extend a cached 1,000-token group prefix, a third a cached
1,500-token one (10 groups each), a third are cold; default budgets. The pass (index refresh,
policy order, admission) is reported apart from the whole step, which adds KV allocation and
batch building (per admitted token, not per waiting request). Between passes (untimed) the
batch's output is applied, the admitted requests are aborted and as many fresh ones of the same
kinds queued, so the queue's length and mix stay put (use --passes 300 for a steady state). The baseline, measured on the same queue in the same run, is
SGLang's approach: re-match every waiting request and sort.

The second table holds the queue at 10,000 waiting requests and the batch at 256 running ones
(all decoding, ``--max-running-requests 256``) and grows the prompts from 1,000 to 4,000 tokens
(group prefixes half and three quarters of a prompt): a decode step (``step()`` then
``on_output()``) and a pass (the same queue, with room to admit) must cost the same at every
length, as no per-step work may be proportional to prompt lengths; "x shortest" is the ratio
to the shortest prompts.

    python benchmarks/schedule_bench.py [--sizes 128 1000 10000] [--passes 30]
        [--prompt-lens 1000 2000 4000]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from _machine import machine_line
from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.batch import Batch, StepResult
from radixserve.sched.request import Req, SamplingParams
from radixserve.sched.scheduler import Scheduler

PROMPT, GROUPS = 2000, 10
POOL = 1_000_000  # distinct token ids; prompts are slices of it, so they share int objects


class Workload:
    """Makes requests of ``prompt`` tokens: a third per kind (a group prefix of half the
    prompt, of three quarters, cold). Each Req turns its list into an array once."""

    def __init__(self, prompt: int = PROMPT, max_new_tokens: int = 16) -> None:
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.tokens = list(range(POOL))
        self.lens = (prompt // 2, prompt * 3 // 4)
        self.prefixes = {
            n: [self.tokens[POOL - (g + 1) * 2 * prompt :][:n] for g in range(GROUPS)]
            for n in self.lens
        }
        self.counter = itertools.count()

    def _unique(self, i: int, n: int) -> list[int]:
        start = (i * 97) % (POOL - 20 * GROUPS * self.prompt)  # distinct first token per request
        return self.tokens[start : start + n]

    def request(self, kind: int | None = None) -> Req:
        """The next request; of ``kind`` (0: short group prefix, 1: long, 2: cold) if given."""
        i = next(self.counter)
        kind = i % 3 if kind is None else kind
        if kind == 2:
            ids = self._unique(i, self.prompt)
        else:
            prefix = self.prefixes[self.lens[kind]][i // 3 % GROUPS]
            ids = prefix + self._unique(i, self.prompt - len(prefix))
        return Req(f"k{kind}-{i}", ids, SamplingParams(max_new_tokens=self.max_new_tokens))


def fake_result(batch: Batch) -> StepResult:
    return StepResult([1 if e.sample else None for e in batch.entries])


def build(policy: str, n: int, work: Workload, **sched_kw: int) -> Scheduler:
    cfg = SchedulerConfig(schedule_policy=policy, **sched_kw)
    kv = max(400_000, 300 * (work.prompt + 2 * work.max_new_tokens) + 40 * work.prompt)
    sched = Scheduler(cfg, CacheConfig(max_total_tokens=kv), clock=lambda: 0.0)
    for prefix in work.prefixes[work.lens[0]] + work.prefixes[work.lens[1]]:  # warm them
        sched.add_request(Req(f"warm{len(prefix)}-{prefix[0]}", prefix + [0], SamplingParams(1)))
    while (batch := sched.step()) is not None:
        sched.on_output(batch, fake_result(batch))
    for _ in range(n):
        sched.add_request(work.request())
    return sched


def timed_passes(
    sched: Scheduler, work: Workload, passes: int
) -> tuple[float, float, float, float]:
    """Median ms of the queue work of one step() (everything but KV allocation and batch
    building, which cost per admitted token, not per waiting request), median ms of the whole
    step(), and per pass the requests admitted and re-matched by the prefix index."""
    start, spent = sched._start, [0.0]

    def timed_start(*args):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = start(*args)
        spent[0] += time.perf_counter() - t0
        return out

    sched._start = timed_start  # type: ignore[method-assign]
    passes_ms, steps_ms, admitted = [], [], 0
    refreshed = sched.index.refreshed
    for _ in range(passes):
        spent[0] = 0.0
        t0 = time.perf_counter()
        batch = sched.step()
        steps_ms.append((time.perf_counter() - t0) * 1e3)
        passes_ms.append(steps_ms[-1] - spent[0] * 1e3)
        assert batch is not None
        sched.on_output(batch, fake_result(batch))
        for e in batch.entries:  # replace each admitted request by one of its kind, so the
            sched.abort(e.rid)  # queue keeps the workload's mix (LPM admits the hot ones)
            sched.add_request(work.request(kind=int(e.rid[1])))
        admitted += len(batch.entries)
    rematched = (sched.index.refreshed - refreshed) / passes
    return statistics.median(passes_ms), statistics.median(steps_ms), admitted / passes, rematched


def naive_pass(sched: Scheduler) -> float:
    """ms to re-match every waiting request and sort by match length (SGLang's LPM pass)."""
    waiting = [r for r in sched._reqs.values() if r.state.value == "waiting"]
    t0 = time.perf_counter()
    lens = {r.rid: sched.cache.match_prefix(r.fill_ids(), r.namespace).length for r in waiting}
    waiting.sort(key=lambda r: -lens[r.rid])
    return (time.perf_counter() - t0) * 1e3


def decode_steps(work: Workload, running: int, waiting: int, steps: int) -> float:
    """Median ms of a decode step (step() + on_output()) with ``running`` requests decoding
    and ``waiting`` requests queued behind them (the running cap is reached)."""
    sched = build("lpm", 0, work, max_running_requests=running)
    for _ in range(running):
        sched.add_request(work.request())
    while sched.num_running < running or sched.running.chunked is not None:
        batch = sched.step()
        assert batch is not None
        sched.on_output(batch, fake_result(batch))
    for _ in range(waiting):
        sched.add_request(work.request())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = sched.step()
        assert batch is not None and not batch.is_prefill and len(batch.entries) == running
        sched.on_output(batch, fake_result(batch))
        times.append((time.perf_counter() - t0) * 1e3)
    assert sched.num_waiting == waiting
    sched.check_integrity()
    return statistics.median(times)


def prompt_length_table(lens: list[int], passes: int) -> None:
    """Pass and decode step at 10,000 waiting / 256 running, prompt length against time."""
    print(f"\n10,000 waiting, 256 running (decode step) or admitting (pass); {passes} steps each")
    print(f"{'prompt':>7}{'pass ms':>9}{'x shortest':>11}{'decode ms':>11}{'x shortest':>11}")
    first: tuple[float, float] | None = None
    for n in lens:
        work = Workload(n)
        ms, _, _, _ = timed_passes(build("lpm", 10_000, work), work, passes)
        dec = decode_steps(Workload(n, max_new_tokens=100_000), 256, 10_000, passes)
        first = first or (ms, dec)
        print(f"{n:>7}{ms:>9.3f}{ms / first[0]:>10.2f}x{dec:>11.3f}{dec / first[1]:>10.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 1000, 10000])
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--policies", nargs="+", default=["lpm", "dfs-weight"])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1000, 2000, 4000])
    args = ap.parse_args()
    print(machine_line())
    print(f"workload: {PROMPT}-token prompts; 1/3 hit a cached 1,000-token prefix, 1/3 a cached")
    print(f"1,500-token prefix ({GROUPS} groups each), 1/3 cold; default SchedulerConfig budgets")
    head = f"{'policy':<11}{'waiting':>8}{'pass ms':>9}{'us/req':>8}{'step ms':>9}{'admit':>6}{'rematch':>8}"
    print(head + f"{'naive ms':>10}{'us/req':>8}{'naive/pass':>11}")
    work = Workload()
    for policy in args.policies:
        for n in args.sizes:
            sched = build(policy, n, work)
            ms, step_ms, adm, rem = timed_passes(sched, work, args.passes)
            naive = statistics.median(naive_pass(sched) for _ in range(3))
            sched.check_integrity()
            print(
                f"{policy:<11}{n:>8}{ms:>9.3f}{ms * 1e3 / n:>8.3f}{step_ms:>9.2f}{adm:>6.1f}{rem:>8.1f}"
                f"{naive:>10.1f}{naive * 1e3 / n:>8.2f}{naive / ms:>10.1f}x"
            )
    print("pass: index refresh + policy order + admission (what SGLang's LPM pass does);")
    print("step: the whole step(), adding KV allocation and batch building for what it admits")
    if args.prompt_lens:
        prompt_length_table(args.prompt_lens, args.passes)


if __name__ == "__main__":
    main()
