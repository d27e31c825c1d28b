"""What `route --enable-trace` costs the router: requests/s and router CPU per request with and
without tracing, same workers, same load, alternating rounds.

    python benchmarks/trace_overhead.py              # 5 rounds of 4,000 requests, concurrency 64
    python benchmarks/trace_overhead.py --quick

Workers are tests/fake_worker.py processes (instant answers); the traced router exports to an
OTLP/HTTP sink in this process that answers every export at once (what a collector's cost would
add is the collector's). Three spans per request leave the traced router (the request, its
routing decision, the attempt); the engines' own spans are not part of this. Prints medians and
the traced/untraced ratio; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from _machine import machine_line, stop_process
from router_bench import (
    RouterProc,
    cpu_secs,
    distinct_prompts,
    drive,
    run,
    start_workers,
    text_body,
)


class Sink:
    """Takes OTLP/HTTP exports and counts their bytes."""

    def __init__(self) -> None:
        self.exports = self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                sink.bytes += len(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                sink.exports += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class TracedRouter(RouterProc):
    """`route --enable-trace`, sampling `ratio` of the traces (the SDK's own environment)."""

    def __init__(self, urls: list[str], endpoint: str, ratio: float) -> None:
        self.endpoint = endpoint
        env = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
               "OTEL_TRACES_SAMPLER_ARG": str(ratio)}  # fmt: skip
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # RouterProc starts the process with this environment
        try:
            super().__init__("radixserve", urls)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    def command(self, urls: list[str], port: int) -> list[str]:
        return [*super().command(urls, port), "--enable-trace",
                "--otlp-traces-endpoint", self.endpoint]  # fmt: skip


def round_(router: RouterProc, n: int, concurrency: int, seed: int) -> dict:
    cpu0 = cpu_secs(router.pid)
    res = run(drive([router.url], text_body(distinct_prompts(64, seed)), n, concurrency))
    return {"rps": res["rps"], "p50": res["p50"], "p99": res["p99"], "errors": res["errors"],
            "cpu_us": (cpu_secs(router.pid) - cpu0) / n * 1e6}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="a tenth of the requests, 3 rounds")
    ap.add_argument("--sample", type=float, nargs="+", default=[1.0, 0.1],
                    help="trace sampling ratios, one traced router each")  # fmt: skip
    args = ap.parse_args()
    n, rounds = (args.requests // 10, 3) if args.quick else (args.requests, args.rounds)
    print(machine_line())
    print(f"workload: POST /generate, distinct 64-char prompts, max_new_tokens 4, concurrency "
          f"{args.concurrency}, {rounds} alternating rounds of {n:,} requests per router, "
          "3 fake workers, policy cache_aware")  # fmt: skip
    sink = Sink()
    workers, urls = start_workers(3)
    routers: dict[str, RouterProc] = {}
    try:
        routers = {"untraced": RouterProc("radixserve", urls)}
        for ratio in args.sample:
            routers[f"traced {ratio:g}"] = TracedRouter(urls, sink.endpoint, ratio)
        rows: dict[str, list[dict]] = {k: [] for k in routers}
        for r in range(rounds):
            order = list(routers.items())
            for name, router in order[r % len(order) :] + order[: r % len(order)]:
                rows[name].append(round_(router, n, args.concurrency, r))
        report(rows, sink)
    finally:
        for router in routers.values():
            router.stop()
        for w in workers:
            stop_process(w)
        sink.server.shutdown()


def report(rows: dict[str, list[dict]], sink: Sink) -> None:
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("rps", "p50", "p99", "cpu_us")}
           for k, v in rows.items()}  # fmt: skip
    u = med["untraced"]
    print(f"{'router':<14}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'CPU us/req':>12}"
          f"{'req/s vs untraced':>19}{'CPU vs untraced':>17}  errors")  # fmt: skip
    for name, m in med.items():
        errors = sum(sum(r["errors"].values()) for r in rows[name])
        print(f"{name:<14}{m['rps']:>9.0f}{m['p50']:>9.2f}{m['p99']:>9.2f}{m['cpu_us']:>12.0f}"
              f"{m['rps'] / u['rps']:>18.2f}x{m['cpu_us'] / u['cpu_us']:>16.2f}x  {errors}")  # fmt: skip
    print(f"the sink took {sink.exports} exports, {sink.bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
