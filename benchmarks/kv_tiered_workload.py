"""A tiered prefix workload like llm-d's (issue 27, item 7's last goal): prefix groups whose
working set exceeds two engines' device pools but fits their host tiers + Mooncake Store, on two
real `radixserve serve` engines behind `radixserve route --policy kv_aware`, tiers off vs on.

    python benchmarks/kv_tiered_workload.py                      # 8 groups x 5 prompts, 5-8 min on 2 busy cores
    python benchmarks/kv_tiered_workload.py --groups 6 --per-group 4 --prefix 512

Real processes only: a `mooncake_master` and a store process (`tests/mooncake_harness.py`), two
engines on the built-in SmolLM2-135M (float32, CPU) publishing KV events, and a kv_aware router
following them (`vllm_fleet.Router`). Each prompt is its group's PREFIX random token ids plus a
distinct SUFFIX-token question; `max_new_tokens` OUT, greedy, streamed `/generate` through the
router: TTFT is the first streamed chunk, the last one's `meta_info.cached_tokens_details` says
which tier the cached tokens came from. Requests cycle through the groups (g0, g1, ..., g0, g1,
...) with CONCURRENCY in flight, so an engine's device pool (--max-total-tokens, about two
groups) has always lost a group before it comes back.

Two configurations, same prompts in the same order, one after the other on fresh processes:
- tiers off: the device pool only;
- tiers on: `--enable-hierarchical-cache --hicache-ratio R` (host tier R x the device pool, holds
  every group) and `--hicache-storage-backend mooncake` (write-through to the store process's
  segment; `wait_complete` prefetch), so a group the router sends to the other engine can still
  be loaded.
Printed: mean / p50 / p99 TTFT, requests/s, cached tokens by tier, and tiers-on / tiers-off
ratios (issue goals: mean TTFT <= 0.2x, throughput >= 1.5x). Timings never fail anything.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _fleet import Router, sse_events
from _machine import machine_line
from kv_tier_ttft import BYTES_PER_TOKEN, CHUNK, tokens
from mooncake_harness import MooncakeCluster, backend_ports
from server_harness import ServerProcess

EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
TIERS = ("device", "host", "storage")


def workload(args: argparse.Namespace) -> list[list[int]]:
    """`per_group` rounds over the groups, each prompt its group's prefix + a fresh question."""
    rng = random.Random(27)
    prefixes = [tokens(rng, args.prefix) for _ in range(args.groups)]
    return [prefixes[g] + tokens(rng, args.suffix) for _ in range(args.per_group)
            for g in range(args.groups)]  # fmt: skip


def engine_argv(args: argparse.Namespace, cluster: MooncakeCluster | None) -> list[str]:
    # two engines on this machine's cores: one torch thread each (threads sharing a core stall)
    argv = ["--dtype", "float32", "--max-total-tokens", str(args.device_tokens),
            "--kv-events-config", EVENTS, "--num-threads", str(args.num_threads)]  # fmt: skip
    if cluster is not None:
        cfg = {"master_server_address": cluster.master_rpc,
               **backend_ports(cluster.client_env()), "chunk_size": CHUNK,
               "rpc_timeout_ms": 60000}  # fmt: skip
        argv += ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio),
                 "--hicache-storage-backend", "mooncake",
                 "--hicache-storage-backend-extra-config", json.dumps(cfg),
                 "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip
    return argv


def stream_generate(port: int, ids: list[int], out: int) -> tuple[float, float, dict]:
    """(TTFT, end-to-end seconds, the last chunk's meta_info) of one streamed /generate."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": out, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, meta = None, {}
    for event in sse_events(port, "/generate", body, timeout_s=600):
        if ttft is None:
            ttft = time.perf_counter() - t0
        meta = event.get("meta_info", meta)
    e2e = time.perf_counter() - t0
    return (ttft if ttft is not None else e2e), e2e, meta


def run_config(name: str, args: argparse.Namespace, prompts: list[list[int]],
               cluster: MooncakeCluster | None) -> dict[str, Any]:  # fmt: skip
    engines: list[ServerProcess] = []
    router = None
    try:
        for _ in range(2):
            engines.append(ServerProcess(engine_argv(args, cluster)))
        router = Router("kv_aware", [e.url for e in engines], "")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda ids: stream_generate(router.port, ids, args.out),
                                    prompts))  # fmt: skip
        wall = time.perf_counter() - t0
        store = _storage_counters(engines) if cluster is not None else {}
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            if e.proc.poll() is None:
                e.stop(check=False)
    ttfts = [r[0] for r in results]
    cached = {t: sum(r[2].get("cached_tokens_details", {}).get(t, 0) for r in results)
              for t in TIERS}  # fmt: skip
    steady = ttfts[args.groups :]  # each group's first request is cold in both configurations
    return {"name": name, "ttfts": ttfts, "steady": steady, "wall": wall,
            "rps": len(prompts) / wall, "cached": cached, "store": store,
            "prompt_tokens": sum(r[2].get("prompt_tokens", 0) for r in results)}  # fmt: skip


def _storage_counters(engines: list[ServerProcess]) -> dict[str, float]:
    """The engines' storage-tier counters (``/get_server_info`` stats), summed: what the store
    did (pages written, dropped, prefetched...), beside what the requests saw."""
    out: dict[str, float] = {}
    for e in engines:
        for key, value in e.stats().items():
            if key.startswith("storage_") and isinstance(value, int | float):
                out[key] = out.get(key, 0) + value
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=512, help="tokens per group prefix")
    ap.add_argument("--suffix", type=int, default=16, help="distinct question tokens")
    ap.add_argument("--out", type=int, default=4, help="max_new_tokens")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--device-tokens", type=int, default=1280, help="--max-total-tokens per engine")
    ap.add_argument("--hicache-ratio", type=float, default=4.0)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per engine")
    args = ap.parse_args()
    if args.prefix % CHUNK:
        sys.exit(f"kv_tiered_workload: --prefix must be a multiple of {CHUNK}")
    prompts = workload(args)
    working = args.groups * args.prefix
    t_start = time.perf_counter()
    off = run_config("tiers off", args, prompts, None)
    cluster = MooncakeCluster(segment_bytes=working * BYTES_PER_TOKEN + (256 << 20))
    try:
        on = run_config("tiers on", args, prompts, cluster)
    finally:
        cluster.stop()
    total = time.perf_counter() - t_start

    print(machine_line())
    host = int(args.device_tokens * args.hicache_ratio)
    print(f"workload: SmolLM2-135M built-in, float32, CPU; {args.groups} groups x "
          f"{args.per_group} prompts = {len(prompts)} requests, cycling through the groups; "
          f"prompt = {args.prefix}-token group prefix + {args.suffix} fresh tokens, "
          f"max_new_tokens {args.out}, greedy, streamed /generate; concurrency "
          f"{args.concurrency}; 2 engines behind `radixserve route --policy kv_aware`")  # fmt: skip
    print(f"working set {working} prefix tokens ({working * BYTES_PER_TOKEN / 2**20:.0f} MiB "
          f"float32 KV) vs device pools 2 x {args.device_tokens} tokens; tiers on: host tier "
          f"2 x {host} tokens (--hicache-ratio {args.hicache_ratio}) + Mooncake Store "
          f"(master + store process, TCP loopback, {CHUNK}-token chunks); wall {total:.0f} s")  # fmt: skip
    head = (f"{'config':>10} {'mean ms':>9} {'p50 ms':>9} {'p99 ms':>9} {'steady mean':>12} "
            f"{'req/s':>7}  cached tokens by tier (of {off['prompt_tokens']} prompt tokens)")  # fmt: skip
    print(head)
    for r in (off, on):
        t = r["ttfts"]
        print(f"{r['name']:>10} {statistics.mean(t) * 1e3:>9.0f} {pct(t, 0.5) * 1e3:>9.0f} "
              f"{pct(t, 0.99) * 1e3:>9.0f} {statistics.mean(r['steady']) * 1e3:>12.0f} "
              f"{r['rps']:>7.3f}  {r['cached']}")  # fmt: skip
    ratio = lambda f: f(on) / f(off)  # noqa: E731
    mean = ratio(lambda r: statistics.mean(r["ttfts"]))
    print(f"tiers on / off: mean TTFT {mean:.3f}x (goal <= 0.2x), "
          f"p50 {ratio(lambda r: pct(r['ttfts'], 0.5)):.3f}x, "
          f"p99 {ratio(lambda r: pct(r['ttfts'], 0.99)):.3f}x, "
          f"steady-state mean (each group's first request left out) "
          f"{ratio(lambda r: statistics.mean(r['steady'])):.3f}x; "
          f"throughput {ratio(lambda r: r['rps']):.2f}x (goal >= 1.5x)")  # fmt: skip
    print("storage tier counters (both engines): "
          + ", ".join(f"{k} {v:g}" for k, v in sorted(on["store"].items()) if v))  # fmt: skip


if __name__ == "__main__":
    main()
