"""Router benchmark: requests/s and added latency versus hitting the workers directly, prefix
affinity and load balance, and router memory; sglang-router side by side when it is installed.

    python benchmarks/router_bench.py                     # everything, about 2-3 minutes
    python benchmarks/router_bench.py --quick             # a tenth of the requests
    python benchmarks/router_bench.py --only affinity --affinity-runs 5

Workers are tests/fake_worker.py processes: instant answers, and a toy LRU prefix cache of
64-character blocks, 32,000 characters per worker (half of the affinity workload's prefixes,
as on GPUs whose KV cache cannot hold every group everywhere), that reports its hit rate. Each
router runs as its own process with its default settings and policy cache_aware; the load
generator is one asyncio process with keep-alive connections. Throughput rounds alternate between the targets and medians are reported, so a
neighbour's burst on a shared machine hits every target alike. Timings never fail anything:
this prints numbers and whether the issue's targets were met, and asserts none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import string
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from _machine import machine_line, stop_process
from radixserve.router.proxy.workers import ConnectionPool

ROOT = Path(__file__).resolve().parents[1]
FAKE_WORKER = ROOT / "tests" / "fake_worker.py"
Body = Callable[[int], bytes]
TARGETS = {"affinity": 0.95, "busiest": 1.10, "memory_mb": 200.0}
WORKER_CACHE_CHARS = 32_000


# ----- processes -----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for i in range(n):
        cmd = [sys.executable, str(FAKE_WORKER), "--port", "0", "--name", f"worker{i}"]
        cmd += ["--cache-chars", str(WORKER_CACHE_CHARS)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        port = int(proc.stdout.readline().split()[1])
        procs.append(proc)
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


class RouterProc:
    """A router process: `kind` is radixserve, radixserve:POLICY, before (radixserve from
    --compare-src, e.g. a checkout of the previous release), sglang or smg."""

    compare_src = ""  # set by main()
    smg_bin = ""

    def __init__(self, kind: str, urls: list[str]) -> None:
        self.kind, port = kind, free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": self.compare_src} if kind == "before" else None
        self.proc = subprocess.Popen(
            self.command(urls, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        ready = "/health" if kind in ("sglang", "smg") else "/liveness"
        asyncio.run(wait_ready(self.url, ready))
        self.pid = self.proc.pid

    def command(self, urls: list[str], port: int) -> list[str]:
        name, _, policy = self.kind.partition(":")
        common = ["--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(port)]
        common += ["--policy", policy or "cache_aware"]
        if name in ("radixserve", "before"):
            return [sys.executable, "-m", "radixserve", "route", *common, "--log-level", "warning"]
        if name == "smg":  # logs every request at info by default: warn, as the others
            metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
            return [self.smg_bin, "launch", *common, *metrics, "--log-level", "warn"]
        metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        module = "sglang_router.launch_router"
        return [sys.executable, "-m", module, *common, *metrics, "--log-level", "warn"]

    def stop(self) -> None:
        stop_process(self.proc)


async def wait_ready(url: str, path: str, timeout: float = 60.0) -> None:
    pool, deadline = ConnectionPool(url), time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await pool.request("GET", path, timeout=2.0)).status == 200:
                return pool.close()
        except (ConnectionError, TimeoutError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


def cpu_secs(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith(field))
    return kb / 1024


# ----- load generation -----


async def drive(urls: list[str], body: Body, n: int, concurrency: int) -> dict:
    """Send `n` POST /generate requests with `concurrency` in flight; request i goes to
    urls[i % len(urls)] (several urls: the client balances over the workers itself)."""
    pools = [ConnectionPool(u, max_idle=concurrency) for u in urls]
    latencies: list[float] = []
    served: list[tuple[int, str]] = []
    errors, counter = Counter(), iter(range(n))

    async def user() -> None:
        for i in counter:
            data, t0 = body(i), time.perf_counter()
            try:
                resp = await pools[i % len(pools)].request("POST", "/generate", data)
            except (ConnectionError, TimeoutError) as exc:
                errors[type(exc).__name__] += 1
                continue
            latencies.append(time.perf_counter() - t0)
            if resp.status != 200:
                errors[resp.status] += 1
            else:
                served.append((i, json.loads(resp.body)["meta_info"]["worker"]))

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    for pool in pools:
        pool.close()
    latencies.sort()
    pct = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3  # noqa: E731
    return {"rps": n / elapsed, "p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0),
            "errors": dict(errors),
            "served": served}  # fmt: skip


def run(coro: object) -> dict:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


def text_body(prompt: Callable[[int], str]) -> Body:
    return lambda i: json.dumps(
        {"text": prompt(i), "sampling_params": {"max_new_tokens": 4}}
    ).encode()


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits + "  ", k=n))


def distinct_prompts(length: int, seed: int) -> Callable[[int], str]:
    """Prompt i differs from every other in its first characters (no shared prefixes)."""
    base = random_text(random.Random(seed), length)
    return lambda i: f"{i:010d}{seed:02d} " + base[13:]


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


# ----- throughput and added latency -----


def throughput(kinds: list[str], urls: list[str], n: int, rounds: int) -> dict[int, dict]:
    """Per prompt length, per target: medians over `rounds` alternating rounds."""
    print(
        f"\n== throughput: POST /generate, distinct prompts, concurrency 64 (and 1: latency "
        f"without queueing); median of {rounds} alternating rounds of {n:,} (8,000 chars: "
        f"{n // 2:,}) =="
    )
    print(
        f"{'target':<12}{'prompt':>7}{'req/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'+p50 ms':>9}"
        f"{'c=1 p50':>9}{'+p50 ms':>9}{'c=1 p99':>9}{'router CPU us/req':>19}"
        f"{'req/s vs best other':>21}  errors"
    )
    routers = {kind: RouterProc(kind, urls) for kind in kinds}
    results: dict[int, dict] = {}
    try:
        for length, count in ((64, n), (8000, n // 2)):
            results[length] = measure_length(routers, urls, length, count, rounds)
            print_throughput(length, results[length])
    finally:
        for router in routers.values():
            router.stop()
    return results


def measure_length(routers: dict, urls: list[str], length: int, count: int, rounds: int) -> dict:
    targets = ["direct", *routers]
    rows: dict[str, list[dict]] = {t: [] for t in targets}
    for r in range(rounds + 1):  # round 0 warms up connections and the routers' code paths
        for t in targets:
            body = text_body(distinct_prompts(length, seed=r * 10 + targets.index(t)))
            proc = routers.get(t)
            dest = urls if proc is None else [proc.url]
            cpu = cpu_secs(proc.pid) if proc else 0.0
            busy = run(drive(dest, body, count if r else count // 10, 64))
            us = (cpu_secs(proc.pid) - cpu) / count * 1e6 if proc else 0.0
            one = run(drive(dest, body, max(100, count // 20), 1))
            if r:
                rows[t].append({**busy, "us": us, "c1": one["p50"], "c1p99": one["p99"]})
    return {t: summarize(rs) for t, rs in rows.items()}


def summarize(rows: list[dict]) -> dict:
    errors = Counter()
    for row in rows:
        errors.update(row["errors"])
    keys = ("rps", "p50", "p99", "us", "c1", "c1p99")
    return {**{k: median(rows, k) for k in keys}, "errors": dict(errors), "rounds": rows}


def strongest_other(res: dict, kind: str) -> str | None:
    """The fastest router measured beside `kind` in this run (incumbents and `before`)."""
    others = [k for k in res if k not in ("direct", kind) and ":" not in k]
    return max(others, key=lambda k: res[k]["rps"], default=None)


def ratio(res: dict, a: str, b: str) -> float:
    return statistics.median(
        x["rps"] / y["rps"] for x, y in zip(res[a]["rounds"], res[b]["rounds"])
    )


def print_throughput(length: int, res: dict) -> None:
    base = res["direct"]
    for kind, r in res.items():
        best = strongest_other(res, kind) if kind != "direct" else None
        vs = f"{ratio(res, kind, best):.2f}x {best}" if best else ""
        print(
            f"{kind:<12}{length:>7}{r['rps']:>8.0f}{r['p50']:>8.2f}{r['p99']:>8.2f}"
            f"{r['p50'] - base['p50']:>+9.2f}{r['c1']:>9.3f}{r['c1'] - base['c1']:>+9.3f}"
            f"{r['c1p99']:>9.3f}{r['us']:>19.0f}{vs:>21}  {r['errors'] or ''}",
            flush=True,
        )


# ----- affinity and balance -----


def worker_stats(urls: list[str], path: str = "/get_server_info", method: str = "GET") -> list:
    async def fetch() -> list[dict]:
        out = []
        for url in urls:
            pool = ConnectionPool(url)
            out.append(json.loads((await pool.request(method, path)).body))
            pool.close()
        return out

    return run(fetch())  # type: ignore[return-value]


def affinity(kinds: list[str], urls: list[str], runs: int, groups: int = 16, n: int = 2000):
    print(
        f"\n== affinity: {groups} groups, 4,000-char shared prefix + 200-char unique suffix, "
        f"{n:,} requests, concurrency 32; {runs} runs (workload seeds), fresh router and "
        "flushed workers each =="
    )
    print(
        f"{'router':<24}{'seed':>5}{'top-worker share min/mean':>27}{'busiest/mean':>14}"
        f"{'worker hit rate':>17}{'req/s':>8}"
    )
    worst: dict[str, dict] = {}
    for seed in range(runs):
        order, body = group_workload(seed, groups, n)
        for kind in kinds:
            worker_stats(urls, "/flush_cache", "POST")
            before = worker_stats(urls)
            router = RouterProc(kind, urls)
            r = run(drive([router.url], body, n, 32))
            router.stop()
            row = affinity_row(r, order, groups, before, worker_stats(urls))
            w = worst.setdefault(kind, row)
            w["min"], w["busiest"] = min(w["min"], row["min"]), max(w["busiest"], row["busiest"])
            print(
                f"{kind:<24}{seed:>5}{row['min']:>14.3f} / {row['mean']:<10.3f}"
                f"{row['busiest']:>14.2f}{row['hit']:>17.3f}{r['rps']:>8.0f}  {r['errors'] or ''}"
            )
    best = (n - groups) / n * (4000 // 64 * 64) / 4200
    print(f"(hit rate if every group stayed on one worker: {best:.3f}; blocks of 64 chars)")
    return worst


def group_workload(seed: int, groups: int, n: int) -> tuple[list[int], Body]:
    """Request i: the prefix of group order[i] plus its own suffix."""
    rng = random.Random(seed)
    prefixes = [random_text(rng, 4000) for _ in range(groups)]
    order = [rng.randrange(groups) for _ in range(n)]
    suffixes = [random_text(rng, 200) for _ in range(n)]
    return order, text_body(lambda i: prefixes[order[i]] + suffixes[i])


def affinity_row(r: dict, order: list[int], groups: int, before: list, after: list) -> dict:
    per_group = [Counter() for _ in range(groups)]
    for i, worker in r["served"]:
        per_group[order[i]][worker] += 1
    shares = [c.most_common(1)[0][1] / sum(c.values()) for c in per_group if c]
    loads = Counter(w for _, w in r["served"])
    cached = sum(a["cached_chars"] - b["cached_chars"] for a, b in zip(after, before))
    prompt = sum(a["prompt_chars"] - b["prompt_chars"] for a, b in zip(after, before))
    return {
        "min": min(shares),
        "mean": sum(shares) / len(shares),
        "busiest": max(loads.values()) / (sum(loads.values()) / len(before)),
        "hit": cached / max(prompt, 1),
    }


# ----- memory -----


def memory(kinds: list[str], urls: list[str], n: int) -> dict[str, float]:
    print(
        f"\n== memory: router RSS after {n:,} distinct 2,000-char prompts, concurrency 64, "
        "default settings =="
    )
    after: dict[str, float] = {}
    body = text_body(distinct_prompts(2000, seed=3))
    for kind in kinds:
        router = RouterProc(kind, urls)
        start = rss_mb(router.pid)
        r = run(drive([router.url], body, n, 64))
        after[kind] = rss_mb(router.pid)
        peak = rss_mb(router.pid, "VmHWM")
        router.stop()
        print(
            f"{kind:<12} RSS {start:>4.0f} MB at start, {after[kind]:>4.0f} MB after, "
            f"peak {peak:>4.0f} MB ({r['rps']:.0f} req/s) {r['errors'] or ''}",
            flush=True,
        )
    return after


# ----- eviction stalls and joining workers (issue 15) -----


def eviction(kinds: list[str], urls: list[str], fill: int, n: int) -> dict[str, dict]:
    """Latency while the cache_aware tree evicts: distinct 8,000-char prompts past the default
    --max-tree-size, at concurrency 8 so that a stall shows in many requests' latency."""
    print(f"\n== eviction: distinct 8,000-char prompts, default --max-tree-size; {fill:,} fill "
          f"the trees, then {n:,} at concurrency 8 ==")  # fmt: skip
    out = {}
    for kind in kinds:
        router = RouterProc(kind, urls)
        run(drive([router.url], text_body(distinct_prompts(8000, seed=5)), fill, 64))
        r = out[kind] = run(drive([router.url], text_body(distinct_prompts(8000, seed=6)), n, 8))
        router.stop()
        print(f"{kind:<12} p50 {r['p50']:6.2f} ms  p99 {r['p99']:6.2f} ms  max {r['max']:6.2f} ms"
              f"  p99/p50 {r['p99'] / r['p50']:4.2f}  {r['errors'] or ''}", flush=True)  # fmt: skip
    return out


def rejoin(kinds: list[str], urls: list[str], before: int, after: int) -> dict[str, float]:
    """A worker removed and added back (as after a crash, with an empty cache): its share of
    the next distinct-prefix requests. Even is 1/N; a herd is near 1."""
    print(f"\n== rejoin: {before:,} distinct 2,000-char prompts, worker0 removed and added back, "
          f"then {after:,} more at concurrency 16: worker0's share (even: {1 / len(urls):.2f}) ==")  # fmt: skip
    out = {}
    for kind in kinds:
        router = RouterProc(kind, urls)
        run(drive([router.url], text_body(distinct_prompts(2000, seed=7)), before, 16))
        for path in ("/remove_worker", "/add_worker"):
            run(_admin(router.url, f"{path}?url={urls[0]}"))
        r = run(drive([router.url], text_body(distinct_prompts(2000, seed=8)), after, 16))
        router.stop()
        got = Counter(w for _, w in r["served"])
        out[kind] = got.get("worker0", 0) / max(1, sum(got.values()))
        print(f"{kind:<12} worker0 took {out[kind]:.2f} of the next {after:,}", flush=True)
    return out


async def _admin(url: str, path: str) -> dict:
    pool = ConnectionPool(url)
    resp = await pool.request("POST", path)
    pool.close()
    return {"status": resp.status}


# ----- summary -----


def verdict(tp: dict | None, aff: dict | None, mem: dict | None) -> None:
    print("\n== targets (issue 6) ==")
    ok = lambda cond: "met" if cond else "MISSED"  # noqa: E731
    for length, res in (tp or {}).items():
        if "sglang" in res:
            rounds = zip(res["radixserve"]["rounds"], res["sglang"]["rounds"])
            ratio = statistics.median(a["rps"] / b["rps"] for a, b in rounds)
            print(
                f"req/s >= sglang-router's, {length}-char prompts: {ratio:.2f}x  {ok(ratio >= 1)}"
            )
    if aff and "radixserve" in aff:
        w = aff["radixserve"]
        print(
            f"each group >= {TARGETS['affinity']:.0%} on one worker: worst {w['min']:.3f}  "
            f"{ok(w['min'] >= TARGETS['affinity'])}"
        )
        print(
            f"busiest worker <= {TARGETS['busiest']:.2f}x mean: worst {w['busiest']:.2f}  "
            f"{ok(w['busiest'] <= TARGETS['busiest'])}"
        )
    if mem and "radixserve" in mem:
        mb = mem["radixserve"]
        sg = f" (sglang-router: {mem['sglang']:.0f} MB)" if "sglang" in mem else ""
        print(f"RSS <= {TARGETS['memory_mb']:.0f} MB: {mb:.0f} MB{sg}  {ok(mb <= 200)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the requests (about 30 s)")
    ap.add_argument("--only", default="throughput,affinity,memory,eviction,rejoin",
                    help="comma-separated")  # fmt: skip
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds per target")
    ap.add_argument("--affinity-runs", type=int, default=3, help="affinity workload seeds")
    ap.add_argument("--no-sglang", action="store_true", help="skip sglang-router")
    ap.add_argument("--smg", default="/tmp/venvs/smg/bin/smg", help="smg 1.13's CLI, if there")
    ap.add_argument("--compare-src", default="",
                    help="also run the router from this PYTHONPATH (e.g. the last release's src/) "
                    "as 'before'")  # fmt: skip
    args = ap.parse_args()
    kinds = ["radixserve"]
    if args.compare_src:
        paths = args.compare_src.split(os.pathsep)
        RouterProc.compare_src = os.pathsep.join(str(Path(p).resolve()) for p in paths)
        kinds.append("before")
    if Path(args.smg).exists():
        RouterProc.smg_bin = args.smg
        kinds.append("smg")
    else:
        print(f"smg is not installed at {args.smg} (pip install smg==1.13.0 in a venv)")
    try:
        import sglang_router  # noqa: F401

        kinds += [] if args.no_sglang else ["sglang"]
    except ImportError:
        print("sglang-router is not installed: radixserve only (pip install sglang-router==0.3.2)")
    scale = 10 if args.quick else 1
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{machine_line()}, load average {load}")
    print(
        f"workload: {args.workers} fake workers (tests/fake_worker.py, instant answers, "
        f"{WORKER_CACHE_CHARS:,}-char LRU prefix cache each), "
        f"routers: {kinds} (default flags, policy cache_aware), client: one asyncio process"
    )
    procs, urls = start_workers(args.workers)
    tp = aff = mem = None
    try:
        if "throughput" in args.only:
            tp = throughput(kinds, urls, 10_000 // scale, args.rounds)
        if "affinity" in args.only:
            aff = affinity([*kinds, "radixserve:round_robin"], urls, args.affinity_runs)
        if "memory" in args.only:
            mem = memory(kinds, urls, 100_000 // scale)
        if "eviction" in args.only:
            eviction([k for k in kinds if k in ("radixserve", "before")], urls,
                     6000 // scale, 4000 // scale)  # fmt: skip
        if "rejoin" in args.only:
            rejoin(kinds, urls, 2000 // scale, 800 // scale)
    finally:
        for proc in procs:
            proc.terminate()
    verdict(tp, aff, mem)
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at the end: {load}" + (" (above the cpu count: noisy)" if busy else ""))


if __name__ == "__main__":
    main()
