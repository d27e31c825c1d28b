"""What the storage tier's write path costs the scheduler thread (issue 27 item 2: "a page is
written once, off the scheduler's critical path"): the time `StorageTier.offer_write` takes on
the calling (scheduler) thread per completed prompt, and how long until the writer thread has
stored its pages.

    python benchmarks/storage_offer_cost.py                          # this checkout only
    python benchmarks/storage_offer_cost.py --baseline-src /path/to/other/checkout/src

With ``--baseline-src`` the same measurement runs first in a subprocess importing radixserve from
that source tree (e.g. main's, whose offer_write gathers the pages on the calling thread), then
here; the ratio is this checkout's over the baseline's, one after the other in the same run.

Real parts, in one process: a device KV pool shaped like SmolLM2-135M's (30 layers, 3 KV heads,
dim 64, float32: 46,080 bytes a token; CPU tensor), the host pool, the scheduler's KVManager and
radix tree, a `file` store in a fresh temporary directory. Each repetition puts a fresh
2,000-token prompt in the tree (as a finished request leaves it) and offers it: 7 whole
256-token chunks = 1,792 tokens, 82.6 MB of KV to gather. The writer is waited for between
repetitions (pins released as the scheduler does between steps), so each offer is timed alone.
Timings never fail anything.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 256
PROMPT = 2000
LAYERS, HEADS, DIM = 30, 3, 64


def measure(reps: int) -> dict:
    import torch

    import radixserve
    from radixserve.cache.hashing import KVNamespace
    from radixserve.config import CacheConfig
    from radixserve.engine.storage_settings import StorageSettings
    from radixserve.engine.storage_tier import StorageTier
    from radixserve.model.host_pool import HostKVPool
    from radixserve.model.kv_pool import KVPool
    from radixserve.sched.kv import KVManager

    total = 4 * PROMPT
    pool = KVPool(LAYERS, total, HEADS, DIM, torch.float32, "cpu")
    pool.kv.normal_()
    host = HostKVPool(pool, total)
    kv = KVManager(CacheConfig(max_total_tokens=total), host_tokens=total)
    new_api = "kv" in inspect.signature(StorageTier.offer_write).parameters
    offer, written = [], []
    with tempfile.TemporaryDirectory() as store:
        settings = StorageSettings("file", {"path": store}, chunk_size=CHUNK)
        tier = StorageTier(settings, KVNamespace("smollm2-shape", "float32", LAYERS, HEADS, DIM,
                                                 CHUNK), host)  # fmt: skip
        pages = 0
        for rep in range(reps + 1):  # the first one warms up
            ids = [200 + (rep * PROMPT + i) % 39000 for i in range(PROMPT)]
            assert kv.ensure_free(PROMPT)
            slots = list(kv.allocator.alloc(PROMPT))
            kv.cache.insert(ids, slots)
            t0 = time.perf_counter()
            if new_api:
                tier.offer_write(ids, None, kv)
            else:
                tier.offer_write(ids, None, slots)
            t1 = time.perf_counter()
            pages += PROMPT // CHUNK
            while tier.stats()["storage_pages_written"] < pages:
                time.sleep(0.0005)
            t2 = time.perf_counter()
            if new_api:
                tier.release_pins(kv, wait_s=5)
            if rep:
                offer.append(t1 - t0)
                written.append(t2 - t0)
        tier.close(kv) if new_api else tier.close()
    return {"src": str(Path(radixserve.__file__).parents[1]), "reps": reps,
            "offer_ms_median": 1e3 * statistics.median(offer),
            "offer_ms_max": 1e3 * max(offer),
            "written_ms_median": 1e3 * statistics.median(written),
            "bytes_per_prompt": (PROMPT // CHUNK) * CHUNK * pool.kv.element_size()
            * LAYERS * 2 * HEADS * DIM}  # fmt: skip


def show(r: dict) -> None:
    print(f"  {r['src']}: offer_write on the scheduler thread median {r['offer_ms_median']:.2f} ms"
          f" (max {r['offer_ms_max']:.2f}); pages stored after {r['written_ms_median']:.1f} ms")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--baseline-src", help="another checkout's src/ to measure first")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the subprocess
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args.reps)))
        return
    from _machine import machine_line

    print(machine_line())
    print(f"workload: {args.reps} prompts of {PROMPT} tokens, {PROMPT // CHUNK} chunks of {CHUNK} "
          f"offered each (SmolLM2-135M KV shape, float32, CPU pool), file store")  # fmt: skip
    results = []
    if args.baseline_src:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.baseline_src)}
        run = subprocess.run([sys.executable, __file__, "--json", "--reps", str(args.reps)],
                             env=env, capture_output=True, text=True, check=True)  # fmt: skip
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    results.append(measure(args.reps))
    print(f"  {results[-1]['bytes_per_prompt'] / 1e6:.1f} MB of KV per prompt")
    for r in results:
        show(r)
    if len(results) == 2:
        b, h = results
        print(f"scheduler-thread time per prompt, this checkout / baseline: "
              f"{h['offer_ms_median'] / b['offer_ms_median']:.4f}x "
              f"({h['offer_ms_median']:.2f} ms vs {b['offer_ms_median']:.2f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
