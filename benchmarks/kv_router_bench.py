"""kv_aware's costs in the router (issue 12, acceptance 6), each against cache_aware in the same run:

1. decision cost per request: kv_aware = tokenize (SmolLM2's real tokenizer) + hash blocks +
   index lookup + score; cache_aware = key + tree match + placement; 64- and 8,000-character
   prompts, 8 workers whose index / tree hold 2,000 earlier prompts sharing 4 system prompts;
2. KV events ingested per second (msgpack map-encoded batches, parsed and applied);
3. index memory per million blocks (tracemalloc);
4. router requests/s in front of `serve --sim` workers publishing KV events (router processes
   of each policy, alternating rounds, medians; router CPU seconds per request beside them).

    python benchmarks/kv_router_bench.py [--quick] [--no-procs]

Timings vary with the machine and its neighbours; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import msgpack  # noqa: E402

from _machine import machine_line  # noqa: E402
from radixserve.router.kvindex.block_index import InMemoryIndex, block_keys  # noqa: E402
from radixserve.router.kvindex.event_format import BlockStored, parse_payload  # noqa: E402
from radixserve.router.policies.base import WorkerView  # noqa: E402
from radixserve.router.policies.config import CachePolicyConfig  # noqa: E402
from radixserve.router.policies.kv_aware import KvAwarePolicy  # noqa: E402
from radixserve.router.policies.registry import create_policy  # noqa: E402
from radixserve.router.proxy.kv_setup import load_tokenizer, prompt_ids  # noqa: E402
from radixserve.router.proxy.request_body import request_view  # noqa: E402
from radixserve.router.proxy.workers import ConnectionPool  # noqa: E402
from router_bench import cpu_secs, free_port, wait_ready  # noqa: E402

WORKERS = [WorkerView(f"w{i}") for i in range(8)]
BS = 16
NO_EVICTION = CachePolicyConfig(eviction_interval_secs=0)


def text(rng: random.Random, chars: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))))
    return " ".join(words)[:chars]


def prompts(chars: int, n: int, seed: int = 0) -> list[str]:
    """`n` prompts of `chars` characters: one of 4 system prompts (3/4 of it), then a question."""
    rng = random.Random(seed)
    systems = [text(rng, chars * 3 // 4) for _ in range(4)]
    return [rng.choice(systems) + text(rng, chars - chars * 3 // 4) for _ in range(n)]


# ----- 1. decision cost -----


def decision_cost(chars: int, n: int, tok) -> dict[str, float]:
    warm, timed = prompts(chars, 2000, seed=1), prompts(chars, n, seed=2)
    cache, kv = create_policy("cache_aware", NO_EVICTION), KvAwarePolicy(NO_EVICTION)
    for i, p in enumerate(warm):  # both policies learn the same placements
        w = WORKERS[i % len(WORKERS)].id
        cache.on_dispatch(w, request_view({"text": p}), 0.0)
        ids = prompt_ids({"text": p}, tok)
        whole = len(ids) - len(ids) % BS
        hashes = tuple(range(i << 20, (i << 20) + whole // BS))
        kv.index.apply(w, [BlockStored(hashes, None, tuple(ids[:whole]), BS)])
    out: dict[str, list[float]] = {"cache_aware": [], "kv_aware": [], "tokenize": [], "hash": []}
    for p in timed:
        payload = {"text": p}
        t0 = time.perf_counter()
        cache.select(WORKERS, request_view(payload), 1.0)
        t1 = time.perf_counter()
        view = request_view(payload)
        ids = prompt_ids(payload, tok)
        t2 = time.perf_counter()
        block_keys(ids, BS)
        t3 = time.perf_counter()
        kv.select(WORKERS, dataclasses.replace(view, token_ids=ids), 1.0)
        t4 = time.perf_counter()
        out["cache_aware"].append(t1 - t0)
        out["kv_aware"].append((t2 - t1) + (t4 - t3))  # select hashes the blocks itself
        out["tokenize"].append(t2 - t1)
        out["hash"].append(t3 - t2)
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}


# ----- 2. events ingested per second -----


def event_payloads(batches: int, blocks: int = 4) -> list[bytes]:
    """Map-encoded batches (vLLM 0.32's form) of chained BlockStored, every 8th a removal."""
    out, parent = [], None
    for b in range(batches):
        hashes = [b * blocks + k for k in range(blocks)]
        tokens = list(range(b * blocks * BS, (b + 1) * blocks * BS))
        ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
              "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
              "lora_name": None, "extra_keys": None, "group_idx": 0,
              "kv_cache_spec_kind": "full_attention"}  # fmt: skip
        events = [ev]
        if b % 8 == 7:
            events.append({"type": "BlockRemoved", "block_hashes": [hashes[-1]], "medium": "GPU"})
        out.append(msgpack.packb([time.time(), events, 0]))
        parent = hashes[-1] if b % 64 else None  # chains of 64 batches
    return out


def ingest_rate(batches: int) -> dict[str, float]:
    payloads, index = event_payloads(batches), InMemoryIndex()
    t0 = time.perf_counter()
    for p in payloads:
        index.apply("w0", parse_payload(p).events)
    dt = time.perf_counter() - t0
    return {"events_per_s": index.stats.events / dt, "blocks_per_s": index.stats.stored / dt}


# ----- 3. memory -----


def index_memory(blocks: int) -> float:
    """Bytes per block held, over 8 workers, chains of 64 blocks of 16 tokens."""
    tracemalloc.start()
    index = InMemoryIndex()
    base = tracemalloc.get_traced_memory()[0]
    per_worker = blocks // len(WORKERS)
    for wi, w in enumerate(WORKERS):
        for start in range(0, per_worker, 64):
            n = min(64, per_worker - start)
            toks = tuple(range(wi * 10**8 + start * BS, wi * 10**8 + (start + n) * BS))
            hashes = tuple(range(wi * 10**8 + start, wi * 10**8 + start + n))
            index.apply(w.id, [BlockStored(hashes, None, toks, BS)])
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert sum(index.blocks().values()) == per_worker * len(WORKERS)
    return used / (per_worker * len(WORKERS))


# ----- 4. router requests/s -----


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def drive(url: str, bodies: list[bytes], concurrency: int) -> float:
    pool, it, statuses = ConnectionPool(url, max_idle=concurrency), iter(bodies), Counter()

    async def user() -> None:
        for body in it:
            statuses[(await pool.request("POST", "/generate", body, timeout=120.0)).status] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    dt = time.perf_counter() - t0
    pool.close()
    if set(statuses) != {200}:
        print(f"  warning: {url} answered {dict(statuses)}")
    return len(bodies) / dt


def router_rps(n: int, rounds: int, chars: int) -> dict[str, tuple[float, float]]:
    kv_cfg = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
    procs, urls = [], []
    for _ in range(2):
        port = free_port()
        procs.append(start([sys.executable, "-m", "radixserve", "serve", "--sim", "tiny-cpu",
                            "--port", str(port), "--log-level", "warning",
                            "--kv-events-config", kv_cfg]))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    routers = {}
    try:
        for u in urls:
            asyncio.run(wait_ready(u, "/health", 180))
        for policy in ("cache_aware", "kv_aware"):
            port = free_port()
            procs.append(start([sys.executable, "-m", "radixserve", "route", "--port", str(port),
                                "--policy", policy, "--log-level", "warning",
                                "--health-check-timeout-secs", "30",
                                "--worker-urls", *urls]))  # fmt: skip
            routers[policy] = (f"http://127.0.0.1:{port}", procs[-1])
            asyncio.run(wait_ready(routers[policy][0], "/health", 60))
        time.sleep(2)  # kv_aware: tokenizer learned, subscribers connected
        bodies = [
            json.dumps({"text": p, "sampling_params": {"max_new_tokens": 1}}).encode()
            for p in prompts(chars, n, seed=3)
        ]
        rps: dict[str, list[float]] = {k: [] for k in routers}
        cpu: dict[str, list[float]] = {k: [] for k in routers}
        for _ in range(rounds):
            for policy, (url, proc) in routers.items():
                c0 = cpu_secs(proc.pid)
                rps[policy].append(asyncio.run(drive(url, bodies, 32)))
                cpu[policy].append((cpu_secs(proc.pid) - c0) / n * 1e6)
        return {k: (statistics.median(rps[k]), statistics.median(cpu[k])) for k in routers}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and blocks")
    parser.add_argument("--no-procs", action="store_true", help="skip the process benchmark")
    args = parser.parse_args()
    q = 10 if args.quick else 1
    print(machine_line())
    tok = load_tokenizer("built-in:")
    print(f"tokenizer: {tok.name} ({tok.fingerprint()}); 8 workers; blocks of {BS} tokens")
    print("\n1. decision cost per request (median us; prompts share 4 system prompts)")
    print(f"{'prompt':>12}  {'cache_aware':>11}  {'kv_aware':>9}  {'tokenize':>9}  "
          f"{'hash':>6}  {'kv/cache':>8}")  # fmt: skip
    for chars, n in ((64, 3000 // q), (8000, 600 // q)):
        r = decision_cost(chars, n, tok)
        print(
            f"{chars:>9} ch  {r['cache_aware']:11.1f}  {r['kv_aware']:9.1f}  "
            f"{r['tokenize']:9.1f}  {r['hash']:6.1f}  {r['kv_aware'] / r['cache_aware']:7.1f}x"
        )
    r = ingest_rate(20_000 // q)
    print(
        f"\n2. events ingested: {r['events_per_s']:,.0f} events/s, "
        f"{r['blocks_per_s']:,.0f} blocks/s (batches of 4 blocks, map encoding, one thread)"
    )
    per = index_memory(1_000_000 // q)
    print(f"\n3. index memory: {per:.0f} bytes per block = {per:.0f} MB per million blocks")
    if args.no_procs:
        return
    n, rounds = 600 // q, 3
    print(
        f"\n4. router in front of 2 serve --sim tiny-cpu workers publishing KV events: "
        f"{n} requests of 2,000 characters, 32 in flight, {rounds} alternating rounds"
    )
    res = router_rps(n, rounds, 2000)
    for policy, (rps, cpu) in res.items():
        print(f"  {policy:12} {rps:8.0f} req/s   router CPU {cpu:6.0f} us/request")
    ratio = res["kv_aware"][0] / res["cache_aware"][0]
    print(f"  kv_aware / cache_aware: {ratio:.2f}x req/s")


if __name__ == "__main__":
    main()
