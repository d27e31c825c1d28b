"""What `serve --enable-trace` costs an engine: requests/s and CPU per request (the API, scheduler
and detokenizer processes together) of a `serve --sim tiny-cpu` engine traced and untraced, same
load, alternating rounds.

    python benchmarks/trace_engine_overhead.py          # 5 rounds of 1,000 requests
    python benchmarks/trace_engine_overhead.py --quick

Four spans per request leave a traced engine (the HTTP request in the API process; queue,
prefill and decode recorded by the scheduler process); they go to an OTLP/HTTP sink in this
process that answers at once. A simulated engine sleeps out its steps, so CPU per request is the
figure to read. Prints medians and the traced/untraced ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

from _machine import machine_line, stop_process
from radixserve.router.proxy.workers import ConnectionPool
from router_bench import distinct_prompts, free_port, run, text_body, wait_ready
from trace_overhead import Sink


class Engine:
    def __init__(self, traced_to: str | None) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "radixserve", "serve", "--sim", "tiny-cpu", "--port",
               str(port), "--max-total-tokens", "65536", "--log-level", "warning"]  # fmt: skip
        if traced_to:
            cmd += ["--enable-trace", "--otlp-traces-endpoint", traced_to]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        asyncio.run(wait_ready(self.url, "/health", 120))

    def cpu_secs(self) -> float:
        """CPU time of the server and every process under it."""
        pids, total = [self.proc.pid], 0.0
        while pids:
            pid = pids.pop()
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    pids += [int(p) for p in f.read().split()]
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total


async def drive(url: str, n: int, concurrency: int, seed: int) -> tuple[float, int]:
    """(requests/s, errors) of `n` /generate requests, `concurrency` at once."""
    pool, body, todo = ConnectionPool(url, max_idle=concurrency), text_body(
        distinct_prompts(64, seed)), iter(range(n))  # fmt: skip
    errors = 0

    async def user() -> None:
        nonlocal errors
        for i in todo:
            resp = await pool.request("POST", "/generate", body(i), timeout=60.0)
            errors += resp.status != 200

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    pool.close()
    return n / (time.perf_counter() - t0), errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="a fifth of the requests, 3 rounds")
    args = ap.parse_args()
    n, rounds = (args.requests // 5, 3) if args.quick else (args.requests, args.rounds)
    print(machine_line())
    print(f"workload: POST /generate to serve --sim tiny-cpu, distinct 64-char prompts, "
          f"max_new_tokens 4, concurrency {args.concurrency}, {rounds} alternating rounds of "
          f"{n:,} requests per engine")  # fmt: skip
    sink = Sink()
    engines: dict[str, Engine] = {}
    try:
        engines = {"untraced": Engine(None), "traced": Engine(sink.endpoint)}
        rows: dict[str, list[tuple[float, float, int]]] = {k: [] for k in engines}
        for r in range(rounds):
            for name in ("untraced", "traced") if r % 2 == 0 else ("traced", "untraced"):
                e = engines[name]
                cpu0 = e.cpu_secs()
                rps, errors = run(drive(e.url, n, args.concurrency, r))
                rows[name].append((rps, (e.cpu_secs() - cpu0) / n * 1e6, errors))
        report(rows, sink)
    finally:
        for e in engines.values():
            stop_process(e.proc)
        sink.server.shutdown()


def report(rows: dict[str, list[tuple[float, float, int]]], sink: Sink) -> None:
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
           for k, v in rows.items()}  # fmt: skip
    print(f"{'engine':<10}{'req/s':>9}{'CPU us/req':>12}  errors")
    for name, (rps, cpu) in med.items():
        print(f"{name:<10}{rps:>9.0f}{cpu:>12.0f}  {sum(r[2] for r in rows[name])}")
    (t_rps, t_cpu), (u_rps, u_cpu) = med["traced"], med["untraced"]
    print(f"traced / untraced: req/s {t_rps / u_rps:.2f}x, CPU per request {t_cpu / u_cpu:.2f}x; "
          f"the sink took {sink.exports} exports, {sink.bytes / 1e6:.1f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
