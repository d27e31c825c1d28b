"""Prefill and decode apart on real engines: 1 prefill + 1 decode `radixserve serve` behind
`radixserve route --pd-disaggregation` against 2 aggregated engines behind `radixserve route
--policy cache_aware`, each engine pinned to one core (the same two cores in both setups), on one
workload: long distinct prompts arriving at a steady rate beside long streamed generations.
Reported per run: TBT (time between streamed tokens) p50 / p99 / max of the long generations
and p90 of each generation's longest gap, TTFT p50 / p99 of every request and of the long
prompts, output tokens/s and requests/s, and the ratios PD / aggregated within each round, with
their spread over rounds.

    python benchmarks/pd_fleet.py                  # 2 rounds (PD first, then aggregated first): ~35 min on 2 shared cores
    python benchmarks/pd_fleet.py --rounds 3 --duration 240
    python benchmarks/pd_fleet.py --rounds 1 --duration 1 --prompt-tokens 200 300 \\
        --gen-tokens 8 12 --prompt-interval 1 --gen-interval 1      # the smallest

The engines run the built-in SmolLM2-135M (float32, one torch thread, `taskset -c CORE`) with
--max-total-tokens KV pools; a setup's engines start for its run and stop after it, so at most
two run at once. Every request is a streamed /generate with `input_ids` (random, so no two
prompts share a prefix), greedy, `ignore_eos`: a long prompt (uniform in --prompt-tokens) every
--prompt-interval seconds with a few output tokens, and a generation (a --gen-prompt-tokens
prompt, uniform in --gen-tokens outputs) every --gen-interval seconds, both from the start of
the run until --duration; then the run drains. The same requests, at the same offsets, go to
both setups. A TBT sample is the time between two streamed events that carried new tokens (the
average tokens per event is printed). Before each run one short request warms each engine (not
measured). Timings never fail anything: this prints.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from _fleet import Router, free_port, sse_events
from _machine import machine_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_harness import ServerProcess, cpu_seconds  # noqa: E402

SETUPS = ("pd", "aggregated")
VOCAB = (1000, 40000)  # token ids drawn for prompts: SmolLM2's vocabulary is 49,152


@dataclass(frozen=True)
class Sent:
    """One request of the workload: when it is sent (seconds after the run starts), its kind
    ("prompt": a long prompt; "gen": a long generation), its prompt and its output length."""

    at: float
    kind: str
    ids: list[int]
    new_tokens: int


@dataclass
class Got:
    """What one request saw: seconds to its first token, when each streamed event that carried
    tokens came (perf_counter), how many tokens and such events it got, and an error if any."""

    kind: str
    ttft: float = 0.0
    times: list[float] = field(default_factory=list)
    tokens: int = 0
    events: int = 0
    error: str = ""


def workload(args: argparse.Namespace) -> list[Sent]:
    rnd = random.Random(args.seed)
    ids = lambda n: [rnd.randrange(*VOCAB) for _ in range(n)]  # noqa: E731
    out = [Sent(t, "prompt", ids(rnd.randint(*args.prompt_tokens)), args.prompt_new_tokens)
           for t in _times(args.prompt_interval, 0.0, args.duration)]  # fmt: skip
    out += [Sent(t, "gen", ids(args.gen_prompt_tokens), rnd.randint(*args.gen_tokens))
            for t in _times(args.gen_interval, args.gen_interval / 2, args.duration)]  # fmt: skip
    return sorted(out, key=lambda s: s.at)


def _times(every: float, first: float, until: float) -> list[float]:
    """Send times from ``first``, every ``every`` seconds, before ``until`` (at least one)."""
    n = max(1, math.ceil((until - first) / every))
    return [first + i * every for i in range(n)]


def send(port: int, req: Sent, t0: float) -> Got:
    """Sleep until the request's offset, stream it, and time every event that brought tokens."""
    time.sleep(max(0.0, t0 + req.at - time.perf_counter()))
    body = {"input_ids": req.ids, "stream": True, "sampling_params": {
        "max_new_tokens": req.new_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    got, start, times = Got(req.kind), time.perf_counter(), []
    try:
        for event in sse_events(port, "/generate", body, timeout_s=1800):
            n = event["meta_info"]["completion_tokens"]
            if n > got.tokens:
                times.append(time.perf_counter())
                got.tokens, got.events = n, got.events + 1
    except Exception as e:  # a failed request is counted and reported, never fatal
        got.error = f"{type(e).__name__}: {e}"[:300]
    got.ttft, got.times = (times[0] - start if times else 0.0), times
    got.error = got.error or ("" if got.tokens == req.new_tokens else f"{got.tokens} tokens")
    return got


def run_workload(port: int, reqs: list[Sent]) -> tuple[list[Got], float]:
    with ThreadPoolExecutor(len(reqs)) as pool:
        t0 = time.perf_counter() + 0.5  # every thread started before the first send
        got = list(pool.map(lambda r: send(port, r, t0), reqs))
    return got, time.perf_counter() - t0


def engine_args(args: argparse.Namespace, *extra: str) -> list[str]:
    return ["--dtype", "float32", "--num-threads", "1", "--max-total-tokens",
            str(args.max_total_tokens), *extra]  # fmt: skip


def start(setup: str, args: argparse.Namespace) -> tuple[list[ServerProcess], Router]:
    """The setup's two engines (each pinned to its core, loaded at once) and its router."""
    boot = free_port()
    roles = (["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)],
             ["--disaggregation-mode", "decode"]) if setup == "pd" else ([], [])  # fmt: skip
    launch = lambda i: ServerProcess(engine_args(args, *roles[i]), 600.0,  # noqa: E731
                                     prefix=["taskset", "-c", str(args.cores[i])])  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(launch, i) for i in range(2)]
    engines = [f.result() for f in futures if f.exception() is None]
    if len(engines) < 2:
        stop_all(engines)
        raise RuntimeError(f"{setup}: an engine did not start: {futures[0].exception()}"
                           f" / {futures[1].exception()}")  # fmt: skip
    urls = [e.url for e in engines]
    try:
        pd = (urls[0], boot, urls[1]) if setup == "pd" else None
        return engines, Router("cache_aware", [] if pd else urls, pd=pd)
    except BaseException:
        stop_all(engines)
        raise


def stop_all(engines: list[ServerProcess], router: Router | None = None) -> None:
    if router is not None:
        router.stop()
    for e in engines:
        if e.proc.poll() is None:
            e.stop(check=False)


def warm(setup: str, engines: list[ServerProcess], router: Router) -> None:
    """One short request through each engine (in PD, one through the pair), not measured."""
    req = Sent(0.0, "warm-up", list(range(VOCAB[0], VOCAB[0] + 32)), 4)
    ports = [router.port] if setup == "pd" else [e.port for e in engines]
    for port in ports:
        got = send(port, req, time.perf_counter())
        if got.error:
            raise RuntimeError(f"{setup}: the warm-up request failed: {got.error}")


def measure(setup: str, reqs: list[Sent], args: argparse.Namespace) -> dict:
    engines, router = start(setup, args)
    try:
        warm(setup, engines, router)
        load, cpu = os.getloadavg()[0], [cpu_seconds(e.tree()) for e in engines]
        got, wall = run_workload(router.port, reqs)
        cpu = [cpu_seconds(e.tree()) - c for e, c in zip(engines, cpu)]
    finally:
        stop_all(engines, router)
    return summarize(got, wall) | {"load": (load, os.getloadavg()[0]), "cpu": cpu}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(got: list[Got], wall: float) -> dict:
    ok = [g for g in got if not g.error]
    gaps = [b - a for g in ok if g.kind == "gen" for a, b in zip(g.times, g.times[1:])]
    longest = [max(b - a for a, b in zip(g.times, g.times[1:])) for g in ok
               if g.kind == "gen" and len(g.times) > 1]  # fmt: skip
    ttft, long_ttft = [g.ttft for g in ok], [g.ttft for g in ok if g.kind == "prompt"]
    tokens, events = sum(g.tokens for g in ok), sum(g.events for g in ok)
    return {"tbt50": pct(gaps, 0.5) * 1e3, "tbt99": pct(gaps, 0.99) * 1e3,
            "tbtmax": pct(gaps, 1.0) * 1e3, "longest90": pct(longest, 0.9) * 1e3,
            "ttft50": pct(ttft, 0.5), "ttft99": pct(ttft, 0.99),
            "long50": pct(long_ttft, 0.5), "tok_s": tokens / wall, "req_s": len(ok) / wall,
            "failed": [g.error for g in got if g.error], "tbt_n": len(gaps),
            "per_event": tokens / max(1, events), "wall": wall}  # fmt: skip


COLUMNS = (("tbt50", "TBT p50", "ms", 0), ("tbt99", "TBT p99", "ms", 0),
           ("tbtmax", "TBT max", "ms", 0), ("longest90", "longest gap p90", "ms", 0),
           ("ttft50", "TTFT p50", "s", 2), ("ttft99", "TTFT p99", "s", 2),
           ("long50", "long TTFT p50", "s", 2), ("tok_s", "out tok/s", "", 1),
           ("req_s", "req/s", "", 3))  # fmt: skip


def row(label: str, r: dict) -> str:
    cells = "".join(f"{f'{r[k]:.{d}f}{u}':>{len(h) + 2}}" for k, h, u, d in COLUMNS)
    return (f"{label:<24}{cells}  {r['tbt_n']:>5} gaps, {r['per_event']:.2f} tok/event, "
            f"wall {r['wall']:.0f} s, engine CPU {r['cpu'][0]:.0f}/{r['cpu'][1]:.0f} s, "
            f"load {r['load'][0]:.1f}->{r['load'][1]:.1f}, "
            f"failed {len(r['failed'])}")  # fmt: skip


def report(runs: list[tuple[int, str, dict]]) -> None:
    print(f"\n{'run':<24}" + "".join(f"{h:>{len(h) + 2}}" for _, h, _, _ in COLUMNS))
    for rnd, setup, r in runs:
        print(row(f"round {rnd} {setup}", r))
    ratios = {k: [] for k, *_ in COLUMNS}
    for rnd in sorted({r for r, _, _ in runs}):
        both = {s: r for n, s, r in runs if n == rnd}
        for k in ratios:
            ratios[k].append(both["pd"][k] / both["aggregated"][k] if both["aggregated"][k] else
                             float("nan"))  # fmt: skip
    print("\nPD / aggregated, median over rounds [each round's ratio]:")
    for k, h, _, _ in COLUMNS:
        each = ", ".join(f"{x:.3f}" for x in ratios[k])
        print(f"  {h:<16} {statistics.median(ratios[k]):.3f}x  [{each}]")
    tbt = statistics.median(ratios["tbt99"])
    print(f"goal TBT p99 <= 0.5x aggregated's: {'met' if tbt <= 0.5 else 'not met'} ({tbt:.3f}x)")
    for rnd, setup, r in runs:
        for err in sorted(set(r["failed"]))[:3]:
            print(f"  round {rnd} {setup} failed: {err}")


def workload_line(args: argparse.Namespace, reqs: list[Sent]) -> str:
    n_p = sum(r.kind == "prompt" for r in reqs)
    lo, hi = args.prompt_tokens
    return (f"workload: {n_p} long prompts of {lo}-{hi} tokens (random ids, distinct; "
            f"{args.prompt_new_tokens} output tokens) every {args.prompt_interval:g} s and "
            f"{len(reqs) - n_p} generations of {args.gen_tokens[0]}-{args.gen_tokens[1]} tokens "
            f"({args.gen_prompt_tokens}-token prompts) every {args.gen_interval:g} s, over "
            f"{args.duration:g} s; streamed /generate, greedy, ignore_eos; seed {args.seed}"
            f"\nfleets: 2 x `radixserve serve` (built-in SmolLM2-135M, float32, one torch thread, "
            f"--max-total-tokens {args.max_total_tokens}) pinned to cores {args.cores[0]} and "
            f"{args.cores[1]}: pd = prefill + decode behind `route --pd-disaggregation` "
            f"(cache_aware picks the prefill, least_load the decode engine); aggregated = two "
            f"engines behind `route --policy cache_aware`; {args.rounds} rounds, order "
            f"alternating")  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="each runs both setups, order alternating")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of arrivals per run")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[1500, 3000], metavar=("LO", "HI"))
    p.add_argument(
        "--prompt-interval", type=float, default=45.0, help="seconds between long prompts"
    )
    p.add_argument("--prompt-new-tokens", type=int, default=8, help="output of a long prompt")
    p.add_argument("--gen-tokens", type=int, nargs=2, default=[200, 400], metavar=("LO", "HI"))
    p.add_argument("--gen-prompt-tokens", type=int, default=64)
    p.add_argument("--gen-interval", type=float, default=12.0, help="seconds between generations")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool per engine")
    p.add_argument("--cores", type=int, nargs=2, default=None, metavar=("A", "B"),
                   help="cores of the prefill (first) and decode engine; default the first two")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lows = {"rounds": args.rounds, "prompt-new-tokens": args.prompt_new_tokens,
            "gen-prompt-tokens": args.gen_prompt_tokens, "prompt-tokens": min(args.prompt_tokens),
            "gen-tokens": min(args.gen_tokens)}  # fmt: skip
    for name, value in lows.items():
        if value < 1:
            p.error(f"--{name} must be >= 1")
    if min(args.duration, args.prompt_interval, args.gen_interval) <= 0:
        p.error("--duration, --prompt-interval and --gen-interval must be > 0")
    if args.prompt_tokens[0] > args.prompt_tokens[1] or args.gen_tokens[0] > args.gen_tokens[1]:
        p.error("--prompt-tokens and --gen-tokens take LO <= HI")
    cores = sorted(os.sched_getaffinity(0))
    args.cores = args.cores or (cores * 2)[:2]
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the engines on the way out
    reqs = workload(args)
    print(machine_line())
    print(workload_line(args, reqs), flush=True)
    t0, runs = time.monotonic(), []
    for rnd in range(1, args.rounds + 1):
        for setup in SETUPS if rnd % 2 else SETUPS[::-1]:
            r = measure(setup, reqs, args)
            runs.append((rnd, setup, r))
            print(f"  {row(f'round {rnd} {setup}', r)}", flush=True)
    report(runs)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
