"""TTFT by where a prompt's prefix comes from (issue 27, item 7): recomputed, a device-pool hit,
loaded from the host tier, or loaded from Mooncake Store where ANOTHER engine process wrote it.

    python benchmarks/kv_tier_ttft.py                   # 3 repetitions of 1k / 2k / 4k prefixes
    python benchmarks/kv_tier_ttft.py --reps 5 --lengths 2048

Real processes only: a `mooncake_master` and a store process holding the segment
(`tests/mooncake_harness.py`), and three `radixserve serve` engines on the built-in SmolLM2-135M
(float32 on this CPU; 8,192 positions, the longest prompt here is 4,096 + 32 tokens):

- engine C (`--enable-hierarchical-cache`, no storage): recompute (after `/flush_cache`, which
  empties both tiers), then the same prefix again (device hit), then a filler prompt as large as
  the device pool, which pushes the prefix out of the device pool into the host tier (write-through
  copied it there when it was computed), then the prefix again (host hit);
- engine A (storage writer, `--hicache-storage-backend mooncake`) computes each prefix once and
  writes its pages to the store; the benchmark waits until they are all written;
- engine B (storage reader, same flags, `wait_complete`): `/flush_cache` before every request, so
  neither of its tiers holds anything: the prefix is looked up, fetched from the store process's
  segment, landed in B's host tier, copied to the device and only the suffix is computed.

Every request is `prefix + 32 fresh tokens`, `max_new_tokens` 1, greedy: TTFT is the client's
/generate round trip (one output token). `meta_info.cached_tokens_details` of every request is
checked to be the tier under test. Medians over the repetitions, interleaved (rep 1 of every
cell, then rep 2, ...), so a neighbour's burst hits all alike. Ratios are each median over the
recompute median in the same run. Timings never fail anything; needs the mooncake extra (+
Debian's libibverbs1).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _machine import machine_line
from mooncake_harness import MooncakeCluster, backend_ports
from server_harness import ServerProcess

CHUNK = 256
SUFFIX = 32
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (K, V) x kv heads x head dim x fp32


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(27)
        self.device = max(args.lengths) + 512  # one prompt fits; the filler evicts it
        self.procs: list[ServerProcess] = []

    def engine(self, cluster: MooncakeCluster | None, ratio: float) -> ServerProcess:
        argv = ["--max-total-tokens", str(self.device), "--enable-hierarchical-cache",
                "--hicache-ratio", str(ratio)]  # fmt: skip
        if cluster is not None:
            cfg = {"master_server_address": cluster.master_rpc,
                   **backend_ports(cluster.client_env()), "chunk_size": CHUNK,
                   "rpc_timeout_ms": 60000}  # fmt: skip
            argv += ["--hicache-storage-backend", "mooncake",
                     "--hicache-storage-backend-extra-config", json.dumps(cfg),
                     "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip
        p = ServerProcess(argv)
        self.procs.append(p)
        return p

    def ttft(self, p: ServerProcess, ids: list[int]) -> tuple[float, dict]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        t0 = time.perf_counter()
        reply = p.post("/generate", body, timeout=600)
        dt = time.perf_counter() - t0
        assert reply.status == 200, reply.body
        return dt, reply.json()["meta_info"]["cached_tokens_details"]

    def ask(self, p: ServerProcess, prefix: list[int]) -> tuple[float, dict]:
        return self.ttft(p, prefix + tokens(self.rng, SUFFIX))


def flush(p: ServerProcess) -> None:
    reply = p.post("/flush_cache", {})
    assert reply.status == 200, reply.body


def wait_written(p: ServerProcess, pages: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while p.stats().get("storage_pages_written", 0) < pages:
        assert time.monotonic() < deadline, f"engine A wrote < {pages} pages: {p.stats()}"
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if any(n % CHUNK for n in args.lengths):
        sys.exit(f"kv_tier_ttft: --lengths must be multiples of {CHUNK}")
    bench = Bench(args)
    store_bytes = sum(args.lengths) * BYTES_PER_TOKEN
    cluster = MooncakeCluster(segment_bytes=store_bytes + (256 << 20))
    cells: dict[tuple[str, int], list[float]] = {}
    details: dict[tuple[str, int], dict] = {}
    try:
        t_start = time.perf_counter()
        c = bench.engine(None, 3.0)  # host: every prefix + the filler
        a = bench.engine(cluster, 1.5)
        b = bench.engine(cluster, 1.5)
        prefixes = {n: tokens(bench.rng, n) for n in args.lengths}
        filler = tokens(bench.rng, bench.device - SUFFIX - 8)
        for n in args.lengths:
            bench.ask(a, prefixes[n])
        wait_written(a, sum(args.lengths) // CHUNK)
        a.stop()  # B loads what A wrote; A is gone, the pages live in the store process
        for rep in range(args.reps + 1):  # rep 0 warms every path and is not counted
            flush(c)
            for n in args.lengths:
                got = {"recompute": bench.ask(c, prefixes[n]), "device": bench.ask(c, prefixes[n])}
                bench.ask(c, filler)
                got["host"] = bench.ask(c, prefixes[n])
                flush(b)
                got["storage"] = bench.ask(b, prefixes[n])
                for tier, (dt, det) in got.items():
                    if rep:
                        cells.setdefault((tier, n), []).append(dt)
                    details[(tier, n)] = det
        wall = time.perf_counter() - t_start
    finally:
        for p in reversed(bench.procs):
            if p.proc.poll() is None:
                p.stop(check=False)
        cluster.stop()

    print(machine_line())
    print(f"workload: SmolLM2-135M built-in, float32, CPU; prompt = prefix + {SUFFIX} fresh "
          f"tokens, max_new_tokens 1, greedy; device pool {bench.device} tokens; store chunks "
          f"of {CHUNK} tokens ({CHUNK * BYTES_PER_TOKEN / 2**20:.1f} MiB each); "
          f"{args.reps} reps (+1 warm-up), medians; wall {wall:.0f} s")  # fmt: skip
    print(
        "engine C: recompute / device / host; engine B: storage (pages written by engine A, "
        "another process, then stopped; Mooncake master + store process over TCP loopback)"
    )
    head = f"{'prefix':>7} {'tier':>10} {'TTFT p50 ms':>12} {'min ms':>8} {'vs recompute':>13}"
    print(head + "  cached_tokens_details (last rep)")
    for n in args.lengths:
        base = statistics.median(cells[("recompute", n)])
        for tier in ("recompute", "device", "host", "storage"):
            xs = cells[(tier, n)]
            med = statistics.median(xs)
            print(f"{n:>7} {tier:>10} {med * 1e3:>12.1f} {min(xs) * 1e3:>8.1f} "
                  f"{med / base:>12.3f}x  {details[(tier, n)]}")  # fmt: skip


if __name__ == "__main__":
    main()
