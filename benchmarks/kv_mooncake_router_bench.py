"""Router requests/s with `--kv-index mooncake://` (one /batch_query_keys per routed request)
against cache_aware and kv_aware on its in-memory index, all in front of the same workers.

    python benchmarks/kv_mooncake_router_bench.py            # about 2 minutes on a busy 2-core VM
    python benchmarks/kv_mooncake_router_bench.py --quick    # a quarter of the requests

All real processes: a mooncake_master and a store process (tests/mooncake_harness.py), WORKERS
`serve --sim tiny-cpu` workers (simulated steps of tens of microseconds, so the router and the
HTTP path decide the rate) that publish KV events and write each finished prompt's pages to the
store as placeholders under the real keys (--sim-kv-store), and one router process per target.
Workload: token-id prompts of GROUPS shared PREFIX-token prefixes plus a distinct 32-token tail,
4 new tokens each, CONCURRENCY requests in flight from one asyncio client; 256-token store chunks
(Llumnix's default). Rounds alternate between the targets and medians are printed, with each
target's requests/s over cache_aware's in the same run. Every Mooncake decision must have been
answered by the master (its /metrics: kvs_lookups_total, no fallback), or the run says so.
Timings never fail anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _machine import machine_line, stop_process
from mooncake_harness import MooncakeCluster, backend_ports
from radixserve.router.proxy.worker_shapes import parse_prometheus
from radixserve.router.proxy.workers import ConnectionPool
from router_bench import free_port, wait_ready
from server_harness import ServerProcess

WORKERS, GROUPS, PREFIX, TAIL, CHUNK, CONCURRENCY = 4, 16, 1024, 32, 256, 16
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})


def sim_worker(cluster: MooncakeCluster) -> ServerProcess:
    store = {"backend": "mooncake", "master_server_address": cluster.master_rpc,
             **backend_ports(cluster.client_env()), "chunk_size": CHUNK}  # fmt: skip
    return ServerProcess(["--sim", "tiny-cpu", "--max-total-tokens", "65536",
                          "--kv-events-config", EVENTS, "--sim-kv-store", json.dumps(store)])  # fmt: skip


class Router:
    """`radixserve route` over the workers with `flags`; /metrics read as a dict."""

    def __init__(self, name: str, urls: list[str], flags: list[str]) -> None:
        self.name, port = name, free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "radixserve", "route", "--worker-urls", *urls,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        asyncio.run(wait_ready(self.url, "/liveness"))

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            values = parse_prometheus(resp.read().decode())
        return {k.removeprefix("radixserve_router_"): v for k, v in values.items()}

    def stop(self) -> None:
        stop_process(self.proc)


def prompt(i: int, seed: int) -> list[int]:
    rng = random.Random(i % GROUPS)
    head = [rng.randrange(10, 30000) for _ in range(PREFIX)]
    tail = random.Random(seed * 1_000_003 + i).choices(range(10, 30000), k=TAIL)
    return head + tail


def body(ids: list[int]) -> bytes:
    return json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}).encode()


async def drive(url: str, bodies: list[bytes]) -> dict:
    pool = ConnectionPool(url, max_idle=CONCURRENCY)
    latencies: list[float] = []
    errors: Counter = Counter()
    todo = iter(bodies)

    async def user() -> None:
        for data in todo:
            t0 = time.perf_counter()
            try:
                resp = await pool.request("POST", "/generate", data, timeout=60.0)
            except (ConnectionError, TimeoutError) as exc:
                errors[type(exc).__name__] += 1
                continue
            latencies.append(time.perf_counter() - t0)
            if resp.status != 200:
                errors[resp.status] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(CONCURRENCY)))
    elapsed = time.perf_counter() - t0
    pool.close()
    latencies.sort()
    p = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3  # noqa: E731
    return {"rps": len(bodies) / elapsed, "p50": p(0.5), "p99": p(0.99), "errors": dict(errors)}


def wait_until(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument("--requests", type=int, default=400, help="requests per round and target")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.requests // 4 if args.quick else args.requests
    print(machine_line())
    print(f"workload: {WORKERS} `serve --sim tiny-cpu` workers, {GROUPS} groups of {PREFIX}-token "
          f"prefixes + {TAIL} distinct tokens, 4 new tokens, concurrency {CONCURRENCY}, {n} "
          f"requests per round, {args.rounds} rounds alternating; store chunks of {CHUNK}")  # fmt: skip
    cluster = MooncakeCluster(segment_bytes=256 << 20)
    workers: list[ServerProcess] = []
    routers: list[Router] = []
    try:
        workers = [sim_worker(cluster) for _ in range(WORKERS)]
        urls = [w.url for w in workers]
        kv = ["--policy", "kv_aware", "--cache-aware-scheduling-min-tokens", "256"]
        mc = ["--kv-index", f"mooncake://{cluster.metrics_addr}", "--kvs-chunk-size", str(CHUNK)]
        routers = [Router("cache_aware", urls, ["--policy", "cache_aware"]),
                   Router("kv_aware memory", urls, kv),
                   Router("kv_aware mooncake", urls, kv + mc)]  # fmt: skip
        store = routers[-1]
        wait_until(lambda: store.metrics().get("kvs_workers") == WORKERS, "store segments")
        # every group's prefix computed once (and so written to the store) before timing
        asyncio.run(drive(routers[0].url, [body(prompt(g, 0)) for g in range(GROUPS)]))
        rows: dict[str, list[dict]] = {r.name: [] for r in routers}
        before = store.metrics()
        for rnd in range(args.rounds):
            for r in routers:
                bodies = [body(prompt(i, 1 + rnd * 10 + len(rows[r.name]))) for i in range(n)]
                rows[r.name].append(asyncio.run(drive(r.url, bodies)))
        after = store.metrics()
        lookups = after.get("kvs_lookups_total", 0) - before.get("kvs_lookups_total", 0)
        fallbacks = after.get("kvs_fallback_decisions_total", 0) - before.get(
            "kvs_fallback_decisions_total", 0
        )
        loaded = after.get("kv_expected_loaded_tokens_total", 0) - before.get(
            "kv_expected_loaded_tokens_total", 0
        )
        asked = after.get("kvs_lookup_seconds_count", 0) - before.get("kvs_lookup_seconds_count", 0)
        waited = after.get("kvs_lookup_seconds_sum", 0) - before.get("kvs_lookup_seconds_sum", 0)
        base = statistics.median(x["rps"] for x in rows["cache_aware"])
        print(f"{'router':<20}{'req/s':>8}{'vs cache_aware':>16}{'p50 ms':>9}{'p99 ms':>9}  errors")
        for name, xs in rows.items():
            rps = statistics.median(x["rps"] for x in xs)
            errs = sum((Counter(x["errors"]) for x in xs), Counter())
            print(f"{name:<20}{rps:>8.1f}{rps / base:>15.2f}x"
                  f"{statistics.median(x['p50'] for x in xs):>9.1f}"
                  f"{statistics.median(x['p99'] for x in xs):>9.1f}  {dict(errs) or '-'}")  # fmt: skip
        total = n * args.rounds
        print(f"mooncake: {lookups:.0f} master lookups for {total} requests, {fallbacks:.0f} "
              f"fallback decisions, {loaded:.0f} prompt tokens expected loaded from the store; "
              f"mean lookup {waited / max(asked, 1) * 1e3:.2f} ms as the router waited for it")  # fmt: skip
    finally:
        for r in routers:
            r.stop()
        for w in workers:
            w.stop(check=False)
        cluster.stop()


if __name__ == "__main__":
    main()
