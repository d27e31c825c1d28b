"""Storage tier on Mooncake Store: what the backend's framing costs over raw Mooncake, and how
fast the master says where keys live.

    python benchmarks/kvstore_bench.py            # about a minute
    python benchmarks/kvstore_bench.py --quick

1. Throughput, GB/s of page payload, one client process over TCP to the store process's segment
   (a real mooncake_master + mooncake_client on loopback, started here): the mooncake backend's
   put_pages / get_pages (header framing, checksum, checks, one staging copy) against raw
   Mooncake on the same client and the same payload bytes, both raw APIs: put_batch / get_batch
   (bytes objects) and batch_put_from / batch_get_into (registered buffer, zero copy, the API
   the backend is built on). Rounds alternate between the paths, each path leading in turn;
   medians; fresh keys (64 hex digits, as sha256 page keys) for every put (write-once values). Goal: backend <= 1.2x the raw time.
   Pages of 64 KiB, 360 KiB (a 16-token bfloat16 SmolLM2 page) and 11.25 MiB (what the engine
   stores for the built-in model on a CPU: a 256-token chunk in float32; 4 per call). Wall time
   and this process's CPU time (Mooncake's transfer threads run in it) per call; then the
   backend's own work per call measured in process without Mooncake (framing over the raw path's
   copy; header check + copy out), the floor of its overhead on a quiet machine.
2. /batch_query_keys answer time for 8 / 32 / 128 keys (all present), through the metadata
   client (httpx, keep-alive), against the master's /health on the same connection (the HTTP
   round-trip floor); p50 and p99.
Timings never fail anything.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _machine import machine_line
from mooncake_harness import MooncakeCluster, backend_ports, pin_this_process
from radixserve.cache.hashing import block_hashes
from radixserve.kvstore.backends import create_backend
from radixserve.kvstore.storage import HEADER, PageFormat, StorageBackend
from radixserve.router.kvindex.mooncake_client import KvsMetadataConfig, MooncakeMetadataClient
from radixserve.router.kvindex.mooncake_meta import present_prefix

# SmolLM2-135M's KV for one 16-token page: 30 layers x (K, V) x 3 KV heads x 64 dims x 2 bytes
SMOLLM2_PAGE = 30 * 2 * 3 * 64 * 16 * 2
# what `serve --hicache-storage-backend` stores for the built-in model on a CPU: one chunk of
# 256 tokens (the default chunk_size), float32
ENGINE_PAGE = 30 * 2 * 3 * 64 * 256 * 4
_serial = [0]


def fresh_keys(n: int) -> list[str]:
    _serial[0] += 1
    return block_hashes(list(range(16 * n)), 16, "sha256", seed=_serial[0])


class Raw:
    """Raw Mooncake on the backend's own client: same transfer engine, same connection."""

    def __init__(self, store, nbytes: int) -> None:
        self.store = store
        self.buf = bytearray(nbytes)
        self.addr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(self.buf))
        assert store.register_buffer(self.addr, nbytes) == 0

    def put_from(self, keys: list[str], pages: list[bytes], size: int) -> None:
        for i, p in enumerate(pages):
            self.buf[i * size : (i + 1) * size] = p
        codes = self.store.batch_put_from(keys, [self.addr + i * size for i in range(len(keys))],
                                          [size] * len(keys))  # fmt: skip
        assert all(c == 0 for c in codes), codes

    def get_into(self, keys: list[str], size: int) -> None:
        codes = self.store.batch_get_into(keys, [self.addr + i * size for i in range(len(keys))],
                                          [size] * len(keys))  # fmt: skip
        assert all(c == size for c in codes), codes

    def put_batch(self, keys: list[str], pages: list[bytes]) -> None:
        assert self.store.put_batch(keys, pages) == 0

    def get_batch(self, keys: list[str]) -> None:
        assert all(len(v) for v in self.store.get_batch(keys))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_timed(fn) -> tuple[float, float]:
    """(wall, this process's CPU) seconds of one call: Mooncake's transfer threads run in this
    process, so CPU time counts the work each path does, whatever the neighbours' load."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def framing_floor(fmt: PageFormat, pages: list[bytes], reps: int = 20) -> tuple[float, float]:
    """Median ms of the backend's own work per call, in process, no Mooncake: framing ``pages``
    into a staging buffer (header, key digest, checksum, copy) against the bare copy the raw
    batch_put_from path also makes; and checking + copying them out (get) against nothing."""
    size, page = fmt.value_nbytes, fmt.page_nbytes
    staging = bytearray(len(pages) * size)
    view = memoryview(staging)
    keys = fresh_keys(len(pages))
    outs = [bytearray(page) for _ in pages]
    backend_like = _Checker(fmt)

    def frame() -> None:
        for i, (key, p) in enumerate(zip(keys, pages)):
            fmt.frame_into(view[i * size : (i + 1) * size], key, p)

    def copy() -> None:
        for i, p in enumerate(pages):
            staging[i * size + HEADER.size : (i + 1) * size] = p

    def check() -> None:
        for i, (key, out) in enumerate(zip(keys, outs)):
            assert backend_like._accept(key, view[i * size : (i + 1) * size], out)

    frame()
    med = {}
    for name, fn in (("frame", frame), ("copy", copy), ("check", check)):
        med[name] = statistics.median(timed(fn) for _ in range(reps)) * 1e3
        frame()  # check() reads valid frames
    return med["frame"] - med["copy"], med["check"]


class _Checker(StorageBackend):
    """The base class's value check + copy out (`_accept`), the per-page work of get_pages."""

    def exists_prefix(self, keys):  # pragma: no cover - unused
        return 0

    def get_pages(self, keys, buffers):  # pragma: no cover - unused
        return 0

    def put_pages(self, keys, pages):  # pragma: no cover - unused
        return 0


def bench_throughput(cluster: MooncakeCluster, page: int, batch: int, rounds: int) -> None:
    fmt = PageFormat("rkv1-smollm2-135m-bf16-p16", page)
    cfg = {"master_server_address": cluster.master_rpc, **backend_ports(pin_this_process()),
           "batch_pages": batch, "local_buffer_size": 2 * batch * page + (16 << 20)}  # fmt: skip
    backend = create_backend("mooncake", fmt, cfg)
    raw = Raw(backend._store, batch * fmt.value_nbytes)
    pages = [bytes([i % 251]) * page for i in range(batch)]
    bufs = [bytearray(page) for _ in range(batch)]
    read_keys = {name: fresh_keys(batch) for name in ("backend", "raw_into", "raw_bytes")}
    backend.put_pages(read_keys["backend"], pages)
    raw.put_from(read_keys["raw_into"], pages, page)
    raw.put_batch(read_keys["raw_bytes"], pages)
    times: dict[str, list[float]] = {}
    paths = {
        "put backend": lambda: backend.put_pages(fresh_keys(batch), pages),
        "put raw batch_put_from": lambda: raw.put_from(fresh_keys(batch), pages, page),
        "put raw put_batch": lambda: raw.put_batch(fresh_keys(batch), pages),
        "get backend": lambda: backend.get_pages(read_keys["backend"], bufs),
        "get raw batch_get_into": lambda: raw.get_into(read_keys["raw_into"], page),
        "get raw get_batch": lambda: raw.get_batch(read_keys["raw_bytes"]),
    }
    names = list(paths)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each path leads in turn
            fn = paths[name]
            if name.startswith("put"):
                keys = fresh_keys(batch)  # hashing outside the timed call
                fn = _bind_keys(name, backend, raw, keys, pages, page)
            times.setdefault(name, []).append(cpu_timed(fn))
    assert backend.get_pages(read_keys["backend"], bufs) == batch and bufs[3] == pages[3]
    nbytes = batch * page
    print(f"\npage {page:,} B x {batch} pages per call ({nbytes / 1e6:.1f} MB), {rounds} rounds")
    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    for name, t in med.items():
        print(f"  {name:24s} {nbytes / t / 1e9:6.3f} GB/s  ({t * 1e3:7.2f} ms per call, "
              f"{cpu[name] * 1e3:7.2f} ms CPU)")  # fmt: skip
    for op in ("put", "get"):
        into = "batch_put_from" if op == "put" else "batch_get_into"
        plain = "put_batch" if op == "put" else "get_batch"
        for what, m in (("wall", med), ("CPU ", cpu)):
            print(f"  {op} {what}: backend / raw {into} = "
                  f"{m[f'{op} backend'] / m[f'{op} raw {into}']:.2f}x, backend / raw {plain} = "
                  f"{m[f'{op} backend'] / m[f'{op} raw {plain}']:.2f}x")  # fmt: skip
    frame_ms, check_ms = framing_floor(fmt, pages)
    print(f"  the backend's own work per call, in process: framing {frame_ms:.2f} ms over the "
          f"raw path's copy, check + copy out {check_ms:.2f} ms (raw batch_put_from "
          f"{med['put raw batch_put_from'] * 1e3:.2f} ms, batch_get_into "
          f"{med['get raw batch_get_into'] * 1e3:.2f} ms per call here)")  # fmt: skip
    backend.close()


def _bind_keys(name, backend, raw, keys, pages, page):
    if name == "put backend":
        return lambda: backend.put_pages(keys, pages)
    if name == "put raw batch_put_from":
        return lambda: raw.put_from(keys, pages, page)
    return lambda: raw.put_batch(keys, pages)


def bench_query(cluster: MooncakeCluster, reps: int) -> None:
    fmt = PageFormat("model=bench", 256)
    cfg = {"master_server_address": cluster.master_rpc, **backend_ports(pin_this_process())}
    backend = create_backend("mooncake", fmt, cfg)
    client = MooncakeMetadataClient(KvsMetadataConfig(cluster.metrics_addr))
    keys = fresh_keys(128)
    assert backend.put_pages(keys, [bytes(256)] * 128) == 128
    client.query(keys[:1])  # connect
    print(f"\n/batch_query_keys answer time, {reps} queries each (keys present; p50 / p99 ms)")
    health = [timed(lambda: client._sync.get("/health").raise_for_status()) for _ in range(reps)]
    print(f"  /health (HTTP floor)  {_pct(health, 50):6.3f} / {_pct(health, 99):6.3f}")
    for n in (8, 32, 128):
        ts = [timed(lambda n=n: client.query(keys[:n])) for _ in range(reps)]
        assert present_prefix(client.query(keys[:n])) == n
        print(
            f"  {n:4d} keys            {_pct(ts, 50):6.3f} / {_pct(ts, 99):6.3f}"
            f"   ({_pct(ts, 50) / _pct(health, 50):.1f}x /health)"
        )
    client.close()
    backend.close()


def _pct(xs: list[float], p: int) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--queries", type=int, default=400)
    ap.add_argument("--only", default="throughput,query", help="parts to run, comma-separated")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    reps = 100 if args.quick else args.queries
    print(machine_line())
    cluster = MooncakeCluster(segment_bytes=2 << 30)
    try:
        print("Mooncake Store: mooncake-transfer-engine-non-cuda 0.3.13.post1, TCP over loopback, "
              "2 GiB store segment; client mounts none")  # fmt: skip
        parts = set(args.only.split(","))
        for page, batch in ((64 << 10, args.batch), (SMOLLM2_PAGE, args.batch),
                            (ENGINE_PAGE, 4)) if "throughput" in parts else ():  # fmt: skip
            bench_throughput(cluster, page, batch, rounds)
        if "query" in parts:
            bench_query(cluster, reps)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
