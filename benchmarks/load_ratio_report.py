"""The load-to-prefill ratios a real engine reports to a kv_aware router (`/get_loads`'s
`kv_load_to_prefill_ratio` and `kv_store_load_to_prefill_ratio`), after real host and store loads.

    python benchmarks/load_ratio_report.py                    # 4 prefixes of 1,024 tokens, ~1-2 min
    python benchmarks/load_ratio_report.py --groups 6 --prefix 2048

Two engines on the built-in SmolLM2-135M (float32, CPU) share a file store in a temporary
directory (`--hicache-storage-backend file`). Engine A computes GROUPS prompts (a PREFIX of random
token ids plus a 16-token question) and writes their pages. Engine B, whose device pool holds
about two of them and whose host tier holds all, then serves each prompt twice round the groups:
the first round loads each prefix from the store (into the host tier, then to the device), the
second from its host tier (the device pool has lost it by then). Printed: B's ratios at start-up
(its start-up measurement; the store's is null until a prefetch has read pages) and after the
rounds (running means of every prefill step, host -> device copy and store read it timed,
engine/load_meter.py), with how many samples each mean holds. Timings never fail anything.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_line  # noqa: E402
from radixserve import Engine  # noqa: E402

QUESTION = 16
VOCAB = 49_152  # SmolLM2's
KEYS = ("kv_load_to_prefill_ratio", "kv_store_load_to_prefill_ratio", "kv_load_timed_prefills",
        "kv_load_timed_host_loads", "kv_load_timed_store_loads")  # fmt: skip


def prompts(groups: int, prefix: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(prefix + QUESTION)] for _ in range(groups)]


def engine(store: Path, pool: int, host_ratio: float) -> Engine:
    extra = json.dumps({"path": str(store)})  # 256-token chunks
    return Engine(max_total_tokens=pool, enable_hierarchical_cache=True, hicache_ratio=host_ratio,
                  hicache_storage_backend="file", hicache_storage_backend_extra_config=extra,
                  hicache_storage_prefetch_policy="wait_complete")  # fmt: skip


def write_all(store: Path, ids: list[list[int]], pool: int) -> None:
    """Engine A computes every prompt and waits until its pages are in the store."""
    chunks = sum((len(p) - 1) // 256 for p in ids)
    with engine(store, pool, 2.0) as a:
        for p in ids:
            a.generate(input_ids=p, sampling_params={"max_new_tokens": 1})
        deadline = time.monotonic() + 120
        while a.stats()["storage_pages_written"] < chunks and time.monotonic() < deadline:
            time.sleep(0.1)


def serve_rounds(store: Path, ids: list[list[int]], pool: int) -> tuple[dict, dict, dict]:
    """Engine B: its stats at start-up, after the store round and after the host round."""
    tiers: dict[str, int] = {}
    with engine(store, pool, len(ids) * 1.5) as b:
        reports = [b.stats()]
        for _ in range(2):
            for p in ids:
                out = b.generate(input_ids=p, sampling_params={"max_new_tokens": 1})
                for tier, n in out["meta_info"]["cached_tokens_details"].items():
                    tiers[tier] = tiers.get(tier, 0) + n
            reports.append(b.stats())
    print(f"engine B's cached prompt tokens by tier over both rounds: {tiers}")
    return reports[0], reports[1], reports[2]


def show(label: str, stats: dict[str, Any]) -> None:
    host, store = stats[KEYS[0]], stats[KEYS[1]]
    print(f"{label:<28} host {host!s:>8}   store {store!s:>8}   "
          f"(timed: {stats[KEYS[2]]} prefills, {stats[KEYS[3]]} host loads, "
          f"{stats[KEYS[4]]} store reads)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=1024)
    args = ap.parse_args()
    ids = prompts(args.groups, args.prefix)
    pool = 2 * (args.prefix + QUESTION) + 64  # about two prompts
    print(machine_line())
    print(f"workload: {args.groups} prompts of {args.prefix} + {QUESTION} random tokens, "
          f"SmolLM2-135M float32; engine B's device pool {pool} tokens")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="radixserve-ratio-") as tmp:
        store = Path(tmp) / "kv"
        write_all(store, ids, pool)
        start, stored, hosted = serve_rounds(store, ids, pool)
    print("load-to-prefill ratios engine B reports (seconds to load a token / to prefill one):")
    show("at start-up", start)
    show("after the store round", stored)
    show("after the host round", hosted)


if __name__ == "__main__":
    main()
