"""One worker SIGKILLed under load behind the router, repeated: how many requests fail per run.

    python benchmarks/router_worker_kill.py              # 20 runs
    python benchmarks/router_worker_kill.py --runs 5

Each run starts 3 `radixserve serve --sim tiny-cpu` workers and `radixserve route --policy
cache_aware` (default settings) in front of them, sends 240 non-streaming /generate requests
at concurrency 16 (8 groups of 3,000-character shared prefixes, keep-alive connections) and
SIGKILLs one worker (its whole process group) just before request 120. A failure is any
answer other than 200, or a connection error. Prints one line per run and the total; the
acceptance of issue 25 is 0 failed over 20 runs. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

from _machine import machine_line
from radixserve.router.proxy.workers import ConnectionPool

REQUESTS, CONCURRENCY, KILL_AT, GROUPS, PREFIX_CHARS = 240, 16, 120, 8, 3000


class Child:
    """A child process in its own session, its output drained so that it never blocks."""

    def __init__(self, args: list[str], ready: str, timeout: float = 120.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        found = threading.Event()
        self.match: re.Match[str] | None = None

        def drain() -> None:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                self.lines.append(line)
                if self.match is None and (m := re.search(ready, line)):
                    self.match = m
                    found.set()
            found.set()

        threading.Thread(target=drain, daemon=True).start()
        found.wait(timeout)
        if self.match is None:
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"no {ready!r} from {args[0]}:\n" + "".join(self.lines[-30:]))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(15)


def prefixes(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "lambda"]
    out = []
    for g in range(GROUPS):
        text = f"group {g}:"
        while len(text) < PREFIX_CHARS:
            text += " " + rng.choice(words)
        out.append(text[:PREFIX_CHARS])
    return out


def body(i: int, shared: list[str]) -> bytes:
    text = shared[i % GROUPS] + f" question {i}?"
    return json.dumps({"text": text, "sampling_params": {"max_new_tokens": 8}}).encode()


async def load(addr: str, kill, n: int = REQUESTS) -> list[int | str]:  # noqa: ANN001
    """Statuses of `n` requests at CONCURRENCY; `kill()` runs (in a thread) before KILL_AT."""
    pool, statuses, todo, shared = ConnectionPool(f"http://{addr}"), [], iter(range(n)), prefixes()

    async def user() -> None:
        for i in todo:
            if i == KILL_AT:
                await asyncio.to_thread(kill)
            try:
                resp = await pool.request("POST", "/generate", body(i, shared), timeout=120)
            except (ConnectionError, TimeoutError) as exc:
                statuses.append(type(exc).__name__)
                continue
            statuses.append(resp.status)

    await asyncio.gather(*(user() for _ in range(CONCURRENCY)))
    pool.close()
    return statuses


def start_workers(n: int = 3) -> list[Child]:
    return [
        Child(
            ["serve", "--sim", "tiny-cpu", "--port", "0", "--log-level", "warning"],
            r"serving \S+ on (http://\S+)",
        )  # fmt: skip
        for _ in range(n)
    ]


def start_router(urls: list[str], *flags: str) -> Child:
    args = ["route", "--port", "0", "--log-level", "info", "--policy", "cache_aware",
            "--worker-urls", *urls, *flags]  # fmt: skip
    return Child(args, r"routing on http://(\S+) to")


def run_once() -> tuple[list[int | str], list[str]]:
    """One run: the statuses of every request, and the router's log lines."""
    workers = start_workers()
    router = None
    try:
        router = start_router([w.match.group(1) for w in workers])  # type: ignore[union-attr]
        statuses = asyncio.run(load(router.match.group(1), lambda: workers[0].stop(signal.SIGKILL)))  # type: ignore[union-attr]
        return statuses, router.lines
    finally:
        for child in [*workers, *([router] if router else [])]:
            child.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    print(machine_line())
    print(f"workload: 3 serve --sim tiny-cpu workers, route --policy cache_aware, {REQUESTS} "
          f"/generate at concurrency {CONCURRENCY}, {GROUPS} groups of {PREFIX_CHARS}-char "
          f"prefixes, one worker SIGKILLed before request {KILL_AT}")  # fmt: skip
    total = 0
    for run in range(1, args.runs + 1):
        t0 = time.monotonic()
        statuses, _ = run_once()
        bad = Counter(s for s in statuses if s != 200)
        total += sum(bad.values())
        print(f"run {run:2d}: {sum(bad.values())} of {len(statuses)} failed {dict(bad) or ''}"
              f"({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
    print(f"total: {total} of {REQUESTS * args.runs} failed over {args.runs} runs")


if __name__ == "__main__":
    main()
