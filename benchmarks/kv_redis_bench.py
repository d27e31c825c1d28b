"""Shared KV index in Redis: what it costs the router and what it costs Redis.

    python benchmarks/kv_redis_bench.py            # about 10 minutes on a busy 2-core VM
    python benchmarks/kv_redis_bench.py --quick    # a fifth of the work
    python benchmarks/kv_redis_bench.py --only decision memory

1. Routing decision, in process: parse the request, (Redis: one EVALSHA round trip to a local
   redis-server), select, dispatch hooks; p50/p99 per decision for kv_aware on Redis, kv_aware
   in memory (InMemoryIndex holding the same blocks) and cache_aware, at 2,000- and 8,000-token
   prompts (64 groups, each prefix held by one of 4 workers).
2. Router requests/s, processes: `radixserve route` in front of 4 tests/fake_worker.py workers
   (instant answers), token-id prompts of 2,000 and 8,000 tokens, concurrency 32, medians of
   alternating rounds. The fake workers publish no KV events, so kv_aware in memory scores them
   from its approximate tree; kv_aware on Redis reads blocks this script writes for them.
3. Redis memory per million blocks: INFO memory's used_memory before and after writing blocks
   through the kv-indexer's writer (chains of 64 blocks; 4 workers; 1 or 2 holders per block).
4. Indexer ingestion: event batches (4 BlockStored blocks, some BlockRemoved, as an engine step
   publishes) applied by the kv-indexer's writer and written to Redis, against the in-memory
   index applying the same batches (what a router with --kv-index memory does).
Timings never fail anything; redis-server (Debian's package) must be on PATH.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _machine import machine_line
from radixserve.router.kvindex.block_index import InMemoryIndex
from radixserve.router.kvindex.event_format import BlockRemoved, BlockStored
from radixserve.router.kvindex.redis_reader import KvsConfig, RedisIndexReader
from radixserve.router.kvindex.redis_store import RedisIndexStore
from radixserve.router.kvindex.redis_writer import RedisIndexWriter
from radixserve.router.policies.base import WorkerView
from radixserve.router.policies.cache_aware import CacheAwarePolicy
from radixserve.router.policies.kv_aware import KvAwarePolicy
from radixserve.router.proxy.request_body import request_view
from redis_harness import RedisServer
from router_bench import cpu_secs, drive, free_port, run, start_workers, wait_ready

BLOCK, GROUPS, WORKERS = 16, 64, 4


def group_prefix(g: int, length: int) -> list[int]:
    rng = random.Random(g)
    return [rng.randint(10, 30000) for _ in range(length - BLOCK)]


def payload(g: int, i: int, length: int) -> dict:
    rng = random.Random(i)
    ids = group_prefix(g, length) + [rng.randint(10, 30000) for _ in range(BLOCK)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}


def holder_events(length: int) -> list[tuple[int, list[BlockStored]]]:
    """Per group, (its worker, the event that stores its prefix)."""
    out = []
    for g in range(GROUPS):
        ids = group_prefix(g, length)
        n = len(ids) // BLOCK
        rng = random.Random(-g)
        hashes = tuple(rng.getrandbits(63) for _ in range(n))
        out.append((g % WORKERS, [BlockStored(hashes, None, tuple(ids[: n * BLOCK]), BLOCK)]))
    return out


async def fill(url: str, worker_ids: list[str], length: int) -> RedisIndexWriter:
    import redis.asyncio as aioredis

    writer = RedisIndexWriter(RedisIndexStore(aioredis.Redis.from_url(url)))
    await writer.store.client.flushdb()
    task = asyncio.create_task(writer.run())
    for w, events in holder_events(length):
        writer.apply(worker_ids[w], events)
    assert await writer.flushed(60)
    task.cancel()
    return writer


# ----- 1. decision cost -----


async def filled_indexes(
    redis_url: str, length: int
) -> tuple[list[str], list[WorkerView], InMemoryIndex, RedisIndexReader]:
    """The fleet's worker ids and views, and the same holdings in an in-memory index and in
    Redis (with a reader over it)."""
    ids = [f"http://w{i}" for i in range(WORKERS)]
    views = [WorkerView(w) for w in ids]
    await fill(redis_url, ids, length)
    memory = InMemoryIndex()
    for w, events in holder_events(length):
        memory.apply(ids[w], events)
    return ids, views, memory, RedisIndexReader(KvsConfig(redis_url), lambda url: url)


async def decisions(redis_url: str, length: int, n: int) -> tuple[dict[str, list[float]], float]:
    """Per target, seconds per decision; and Redis' own time per lookup (commandstats), apart
    from the time the router spends waiting for a Redis process that shares its cores."""
    ids, views, memory, reader = await filled_indexes(redis_url, length)
    targets = {"kv_aware redis": KvAwarePolicy(index=reader),
               "kv_aware memory": KvAwarePolicy(index=memory), "cache_aware": CacheAwarePolicy()}  # fmt: skip
    bodies = [json.dumps(payload(i % GROUPS, i, length)).encode() for i in range(n)]
    times: dict[str, list[float]] = {t: [] for t in targets}
    await reader.store.client.config_resetstat()
    for i, body in enumerate(bodies):  # interleaved: a neighbour's burst hits all alike
        for name, policy in targets.items():
            t0 = time.perf_counter()
            view = request_view(json.loads(body))
            if name == "kv_aware redis":
                await reader.prepare(view.token_ids, view.kv_namespace)
            pick = policy.select(views, view, float(i))
            policy.on_dispatch(views[pick].id, view, float(i))
            policy.on_complete(views[pick].id, view, float(i))
            times[name].append(time.perf_counter() - t0)
    stats = (await reader.store.client.info("commandstats")).get("cmdstat_evalsha", {})
    await reader.close()
    return times, float(stats.get("usec_per_call", 0.0))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def print_decisions(length: int, result: tuple[dict[str, list[float]], float]) -> None:
    times, server_us = result
    base = statistics.median(times["kv_aware memory"])
    for name, xs in times.items():
        p50 = statistics.median(xs)
        print(f"{name:<18}{length:>8}{p50 * 1e6:>10.0f}{pct(xs, 0.99):>10.0f}"
              f"{p50 / base:>16.2f}x", flush=True)  # fmt: skip
    print(f"{'(Redis server time per lookup, INFO commandstats)':<54}{server_us:>8.0f} us")


# ----- 2. router requests/s -----


class Router:
    def __init__(self, urls: list[str], *flags: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "radixserve", "route", "--worker-urls", *urls,
               "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning", *flags]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        asyncio.run(wait_ready(self.url, "/liveness"))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def throughput(redis_url: str, urls: list[str], length: int, n: int, rounds: int) -> dict:
    run(fill(redis_url, urls, length))
    routers = {
        "kv_aware redis": Router(urls, "--policy", "kv_aware", "--kv-index", redis_url),
        "kv_aware memory": Router(urls, "--policy", "kv_aware"),
        "cache_aware": Router(urls, "--policy", "cache_aware"),
    }
    rows: dict[str, list[dict]] = {t: [] for t in routers}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for name, router in routers.items():
                bodies = [json.dumps(payload(i % GROUPS, r * n + i, length)).encode()
                          for i in range(n)]  # fmt: skip
                cpu = cpu_secs(router.proc.pid)
                res = run(drive([router.url], bodies.__getitem__, n if r else n // 5, 32))
                if r:
                    res["us"] = (cpu_secs(router.proc.pid) - cpu) / n * 1e6
                    rows[name].append(res)
        fell_back = router_metric(routers["kv_aware redis"].url, "kvs_fallback_decisions_total")
        rows["kv_aware redis"][-1]["note"] = f"{fell_back:.0f} decisions fell back to the tree"
    finally:
        for router in routers.values():
            router.stop()
    return rows


def router_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f"radixserve_router_{name} "):
                return float(line.split()[-1])
    return float("nan")


def print_throughput(length: int, rows: dict[str, list[dict]]) -> None:
    base = rows["cache_aware"]
    for name, rs in rows.items():
        ratio = statistics.median(a["rps"] / b["rps"] for a, b in zip(rs, base))
        med = {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50", "p99", "us")}
        errs = sum(sum(r["errors"].values()) for r in rs)
        print(f"{name:<18}{length:>8}{med['rps']:>8.0f}{med['p50']:>9.2f}{med['p99']:>9.2f}"
              f"{med['us']:>12.0f}{ratio:>15.2f}x  {errs or ''}{rs[-1].get('note', '')}",
              flush=True)  # fmt: skip


# ----- 3. Redis memory, 4. ingestion -----


def chains(n_blocks: int, holders: int, rng: random.Random):
    """(worker, events) batches: chains of 64 blocks, each on `holders` workers."""
    for c in range(n_blocks // 64):
        toks = tuple(rng.randint(10, 30000) for _ in range(64 * BLOCK))
        for h in range(holders):
            hashes = tuple(rng.getrandbits(63) for _ in range(64))
            yield f"http://w{(c + h) % WORKERS}", [BlockStored(hashes, None, toks, BLOCK)]


async def memory_per_million(url: str, n_blocks: int, holders: int) -> float:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    await client.flushdb()
    before = (await client.info("memory"))["used_memory"]
    writer = RedisIndexWriter(RedisIndexStore(client))
    task = asyncio.create_task(writer.run())
    for worker, events in chains(n_blocks, holders, random.Random(holders)):
        writer.apply(worker, events)
        if len(writer.ops) > 64:
            await writer.flushed(60)
    assert await writer.flushed(120)
    task.cancel()
    used = (await client.info("memory"))["used_memory"] - before
    await client.aclose()
    return used / (n_blocks // 64 * 64) * 1e6 / 2**20


def step_batches(n: int, rng: random.Random) -> list[tuple[str, list]]:
    """Engine-step-like batches: 4 new blocks chained on the worker's last, and every 8th
    step the removal of 4 old ones."""
    out, last, held = [], {}, {f"http://w{i}": [] for i in range(WORKERS)}
    for i in range(n):
        w = f"http://w{i % WORKERS}"
        hashes = tuple(rng.getrandbits(63) for _ in range(4))
        toks = tuple(rng.randint(10, 30000) for _ in range(4 * BLOCK))
        events: list = [BlockStored(hashes, last.get(w), toks, BLOCK)]
        last[w] = hashes[-1]
        held[w].extend(hashes)
        if i % 8 == 7 and len(held[w]) > 64:
            events.append(BlockRemoved(tuple(held[w][:4])))
            del held[w][:4]
        out.append((w, events))
    return out


async def ingestion(url: str, n: int) -> tuple[float, float, int]:
    """(batches/s into Redis, batches/s into the in-memory index, events per run)."""
    import redis.asyncio as aioredis

    batches = step_batches(n, random.Random(3))
    t0 = time.perf_counter()
    memory = InMemoryIndex()
    for w, events in batches:
        memory.apply(w, events)
    mem_s = time.perf_counter() - t0
    client = aioredis.Redis.from_url(url)
    await client.flushdb()
    writer = RedisIndexWriter(RedisIndexStore(client))
    task = asyncio.create_task(writer.run())
    t0 = time.perf_counter()
    for i, (w, events) in enumerate(batches):
        writer.apply(w, events)
        if i % 32 == 31:
            await asyncio.sleep(0)  # the subscribers yield between messages too
    assert await writer.flushed(300)
    redis_s = time.perf_counter() - t0
    task.cancel()
    await client.aclose()
    return n / redis_s, n / mem_s, sum(len(e) for _, e in batches)


def section_decisions(server: RedisServer, k: int) -> None:
    print(f"\n== 1. routing decision, in process: {GROUPS} groups on {WORKERS} workers, "
          f"{2000 // k} decisions per target, interleaved ==")  # fmt: skip
    print(f"{'target':<18}{'tokens':>8}{'p50 us':>10}{'p99 us':>10}{'vs kv memory':>17}")
    for length in (2000, 8000):
        print_decisions(length, asyncio.run(decisions(server.url, length, 2000 // k)))


def section_throughput(server: RedisServer, k: int) -> None:
    procs, urls = start_workers(WORKERS)
    rounds, n = 3, 2000 // k
    try:
        print(f"\n== 2. router requests/s: {WORKERS} fake workers, token-id prompts, "
              f"concurrency 32, median of {rounds} rounds of {n} (8,000 tokens: {n // 2}) ==")  # fmt: skip
        print(f"{'target':<18}{'tokens':>8}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}"
              f"{'CPU us/req':>12}{'vs cache_aware':>16}")  # fmt: skip
        for length, count in ((2000, n), (8000, n // 2)):
            print_throughput(length, throughput(server.url, urls, length, count, rounds))
    finally:
        for p in procs:
            p.terminate()


def section_memory(server: RedisServer, k: int) -> None:
    blocks = 1_000_000 // k
    print(f"\n== 3. Redis memory: {blocks:,} blocks written by the kv-indexer's writer ==")
    for holders in (1, 2):
        mib = asyncio.run(memory_per_million(server.url, blocks, holders))
        print(f"{holders} holder(s) per block: {mib:.0f} MiB per million blocks", flush=True)


def section_ingestion(server: RedisServer, k: int) -> None:
    n = 20_000 // k
    redis_rate, mem_rate, events = asyncio.run(ingestion(server.url, n))
    print(f"\n== 4. ingestion: {n:,} engine-step batches ({events:,} events, 4 blocks "
          f"stored per batch, removals every 8th) ==")  # fmt: skip
    print(f"kv-indexer -> Redis : {redis_rate:>9,.0f} batches/s "
          f"({redis_rate * events / n:,.0f} events/s, {redis_rate * 4:,.0f} blocks/s)")  # fmt: skip
    print(f"in-memory index     : {mem_rate:>9,.0f} batches/s  "
          f"(Redis / memory: {redis_rate / mem_rate:.2f}x)")  # fmt: skip


SECTIONS = {"decision": section_decisions, "throughput": section_throughput,
            "memory": section_memory, "ingestion": section_ingestion}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a fifth of the work")
    ap.add_argument("--only", choices=sorted(SECTIONS), nargs="*", help="run only these")
    args = ap.parse_args()
    print(machine_line())
    server = RedisServer()
    try:
        for name, section in SECTIONS.items():
            if not args.only or name in args.only:
                section(server, 5 if args.quick else 1)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
