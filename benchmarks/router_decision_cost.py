"""The router's added latency when kv_aware tokenizes long prompts: on the event loop (before,
`--tokenize-workers 0`) against the tokenizing threads (after, the default), in the same run.

    python benchmarks/router_decision_cost.py            # 7 minutes on a busy 2-core VM
    python benchmarks/router_decision_cost.py --quick    # a fifth of the requests

Workers are tests/fake_worker.py processes (instant answers). Each router is its own process,
`radixserve route --policy kv_aware --tokenizer built-in:SmolLM2-135M` (the built-in model's
real tokenizer), differing only in --tokenize-workers. The client is one asyncio process with
64 keep-alive connections sending distinct prompts (no shared prefixes), so every request is
tokenized and hashed whole. Two workloads:

  long   every request an 8,000-character prompt (issue 26, item 6);
  mixed  16 of the 64 clients send 8,000-character prompts, 48 send 100-character ones: the
         short requests' latency shows whether a long prompt's tokenizing holds them up.

Added latency is the router's percentile minus the same percentile sent straight to the
workers (the client spreading over them itself) in the same round; rounds alternate between
the targets and medians over rounds are printed, so a neighbour's burst on a shared machine
hits every target alike. Goal (issue 26): the router's p99 added latency within 2x its p50.
Timings never fail anything: this prints numbers and asserts none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter

from _machine import machine_line, stop_process
from radixserve.router.proxy.config import TOKENIZE_WORKERS
from radixserve.router.proxy.workers import ConnectionPool
from router_bench import cpu_secs, free_port, run, start_workers, wait_ready

TOKENIZER = "built-in:SmolLM2-135M"
LONG, SHORT = 8000, 100
CONCURRENCY, LONG_CLIENTS_MIXED = 64, 16
WORDS = (
    "the router sends each request to the worker whose cache holds most of its prompt while "
    "keeping load even across engines a block of tokens is hashed into a key and the index "
    "maps keys to workers that announced them over their event streams prefill decode batch "
    "scheduler memory page eviction latency throughput model serving cluster request"
).split()


class Router:
    """A `radixserve route` process with kv_aware and the built-in tokenizer."""

    def __init__(self, urls: list[str], tokenize_workers: int) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "radixserve", "route", "--worker-urls", *urls,
               "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
               "--tokenizer", TOKENIZER, "--tokenize-workers", str(tokenize_workers),
               "--log-level", "warning"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        asyncio.run(wait_ready(self.url, "/liveness"))
        self.pid = self.proc.pid

    def metric(self, name: str) -> float:
        async def get() -> str:
            pool = ConnectionPool(self.url)
            try:
                return (await pool.request("GET", "/metrics", timeout=10.0)).body.decode()
            finally:
                pool.close()

        for line in asyncio.run(get()).splitlines():
            if line.startswith(f"radixserve_router_{name}"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        stop_process(self.proc)


def prompt(rng: random.Random, i: int, chars: int) -> str:
    """A distinct prompt of `chars` characters of English-like words (real token density)."""
    words: list[str] = [f"request {i:08d}:"]
    n = len(words[0])
    while n < chars:
        w = rng.choice(WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:chars]


def body(text: str) -> bytes:
    return json.dumps({"text": text, "sampling_params": {"max_new_tokens": 4}}).encode()


async def drive(urls: list[str], bodies: list[list[bytes]]) -> dict:
    """One client per list in `bodies`, each sending its list one request at a time; request
    k of client c goes to urls[(c + k) % len(urls)]. Latencies (ms) per client kind: "long"
    for clients whose first body is the longest, else "short"."""
    pools = [ConnectionPool(u, max_idle=len(bodies)) for u in urls]
    longest = max(len(b[0]) for b in bodies)
    lat: dict[str, list[float]] = {"long": [], "short": []}
    errors: Counter = Counter()

    async def client(c: int, mine: list[bytes]) -> None:
        kind = "long" if len(mine[0]) == longest else "short"
        for k, data in enumerate(mine):
            t0 = time.perf_counter()
            try:
                resp = await pools[(c + k) % len(pools)].request("POST", "/generate", data)
            except (ConnectionError, TimeoutError) as exc:
                errors[type(exc).__name__] += 1
                continue
            lat[kind].append((time.perf_counter() - t0) * 1e3)
            if resp.status != 200:
                errors[resp.status] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c, b) for c, b in enumerate(bodies)))
    elapsed = time.perf_counter() - t0
    for pool in pools:
        pool.close()
    return {"lat": lat, "rps": sum(len(b) for b in bodies) / elapsed, "errors": dict(errors)}


def workload(name: str, n: int, seed: int) -> list[list[bytes]]:
    """Per client, its request bodies: `n` requests in all."""
    rng = random.Random(seed)
    per = max(1, n // CONCURRENCY)
    longs = CONCURRENCY if name == "long" else LONG_CLIENTS_MIXED
    return [
        [body(prompt(rng, seed * 10**6 + c * per + k, LONG if c < longs else SHORT))
         for k in range(per)]
        for c in range(CONCURRENCY)
    ]  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(name: str, targets: dict[str, Router | None], urls: list[str], n: int, rounds: int):
    """Per target, per round: p50/p99 of the measured kind ("long" for the long workload,
    "short" for mixed), req/s, router CPU per request."""
    kind = "long" if name == "long" else "short"
    rows: dict[str, list[dict]] = {t: [] for t in targets}
    for r in range(rounds + 1):  # round 0 warms up connections and code paths
        for t, router in targets.items():
            bodies = workload(name, n if r else n // 5, seed=r * 10 + list(targets).index(t))
            dest = urls if router is None else [router.url]
            cpu = cpu_secs(router.pid) if router else 0.0
            res = run(drive(dest, bodies))
            us = (cpu_secs(router.pid) - cpu) / n * 1e6 if router else 0.0
            if r:
                xs = res["lat"][kind]
                rows[t].append({"p50": pct(xs, 0.5), "p99": pct(xs, 0.99), "rps": res["rps"],
                                "us": us, "errors": res["errors"]})  # fmt: skip
    return rows


def report(name: str, rows: dict[str, list[dict]]) -> None:
    what = "8,000-char requests" if name == "long" else "100-char requests beside 8,000-char ones"
    print(f"\n== {name}: concurrency {CONCURRENCY}, latency of the {what}; medians over rounds ==")
    print(f"{'target':<26}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}"
          f"{'+p99/+p50':>11}{'router CPU us/req':>19}  errors")  # fmt: skip
    direct = rows["direct"]
    for t, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50", "p99", "us")}
        errors: Counter = Counter()
        for r in rs:
            errors.update(r["errors"])
        if t == "direct":
            added = " " * 29
        else:  # per round: router percentile minus direct percentile of the same round
            a50 = statistics.median(r["p50"] - d["p50"] for r, d in zip(rs, direct))
            a99 = statistics.median(r["p99"] - d["p99"] for r, d in zip(rs, direct))
            ratio = f"{a99 / a50:.2f}" if a50 > 0 else "-"
            added = f"{a50:>9.2f}{a99:>9.2f}{ratio:>11}"
        us = f"{med['us']:>19.0f}" if t != "direct" else f"{'':>19}"
        print(f"{t:<26}{med['rps']:>8.0f}{med['p50']:>9.2f}{med['p99']:>9.2f}"
              f"{added}{us}  {dict(errors) or ''}")  # fmt: skip


def decision_cost() -> None:
    """What one 8,000-character prompt costs the router to tokenize and to hash, in process."""
    from radixserve.router.kvindex.block_index import keys_by_size
    from radixserve.router.proxy.kv_setup import load_tokenizer, prompt_ids

    tok = load_tokenizer(TOKENIZER)
    text = prompt(random.Random(0), 0, LONG)
    payload = {"text": text}
    ids = prompt_ids(payload, tok) or []
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        prompt_ids(payload, tok)
    tokenize = (time.perf_counter() - t0) / reps * 1e3
    t0 = time.perf_counter()
    for _ in range(reps):
        keys_by_size(ids)(16)
    hashing = (time.perf_counter() - t0) / reps * 1e3
    print(f"one {LONG:,}-char prompt = {len(ids):,} tokens: tokenizing {tokenize:.2f} ms, "
          f"hashing at 16-token blocks {hashing:.2f} ms (in process, mean of {reps})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a fifth of the requests")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=640, help="requests per round and target")
    ap.add_argument("--tokenize-workers", type=int, default=TOKENIZE_WORKERS,
                    help="the 'after' router's (default: the router's own)")  # fmt: skip
    ap.add_argument("--only", default="long,mixed", help="comma-separated workloads")
    args = ap.parse_args()
    n = args.requests // (5 if args.quick else 1)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{machine_line()}, load average {load}")
    print(f"workload: {args.workers} fake workers (tests/fake_worker.py, instant answers); "
          f"routers: kv_aware --tokenizer {TOKENIZER}, --tokenize-workers 0 (before: on the "
          f"event loop) and {args.tokenize_workers} (after); {n:,} distinct prompts per round "
          f"and target, {args.rounds} rounds, concurrency {CONCURRENCY}")  # fmt: skip
    decision_cost()
    procs, urls = start_workers(args.workers)
    before = after = None
    try:
        before = Router(urls, 0)
        after = Router(urls, args.tokenize_workers)
        targets: dict[str, Router | None] = {
            "direct": None,
            "before (--tokenize-workers 0)": before,
            f"after (--tokenize-workers {args.tokenize_workers})": after,
        }
        for name in args.only.split(","):
            report(name, measure(name, targets, urls, n, args.rounds))
        for label, r in (("before", before), ("after", after)):
            prompts = r.metric("kv_prompt_tokens_total")
            errs = r.metric("kv_tokenize_errors_total") + r.metric("kv_tokenize_timeouts_total")
            print(f"{label}: {prompts:,.0f} prompt tokens routed on token ids, "
                  f"{errs:.0f} tokenizer errors or timeouts")  # fmt: skip
    finally:
        for r in (before, after):
            if r is not None:
                r.stop()
        for proc in procs:
            proc.terminate()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    print(f"load average at the end: {load}" + (" (above the cpu count: noisy)" if busy else ""))


if __name__ == "__main__":
    main()
