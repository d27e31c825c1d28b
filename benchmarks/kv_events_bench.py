"""What publishing KV events costs an engine: the block tracker on the radix cache, and the
publisher's throughput to a subscriber over loopback TCP.

1. Tracker: a RadixCache of CAPACITY tokens takes a stream of requests (GROUPS prefix groups;
   each prompt = its group's shared prefix + a unique suffix): match, insert, then evict back
   under capacity, as the scheduler does. Timed with and without a BlockTracker listening
   (block_size 16, xxhash64), in alternating repeats; the ratio is the tracker's overhead on
   the cache operations, and the events it produced per second of its own time.
2. Publisher: KVEventPlane batches (events of 16-token blocks) encoded with msgpack and sent by
   the publisher thread to a SUB socket in another thread, against the same payloads sent
   straight on a bare PUB socket (the socket's own ceiling): events/s received and the ratio.

    python benchmarks/kv_events_bench.py [--repeats 5] [--requests 400] [--prompt 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import msgpack
import zmq

from _machine import machine_line
from radixserve.cache.block_events import BlockStored, BlockTracker
from radixserve.cache.radix import RadixCache
from radixserve.config import CacheConfig
from radixserve.engine.kv_events import KVEventPlane, KVEventsConfig

GROUPS, BLOCK, CAPACITY = 10, 16, 200_000


def workload(requests: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(257, 32000) for _ in range(length // 2)] for _ in range(GROUPS)]
    return [prefixes[rng.randrange(GROUPS)] + [rng.randrange(257, 32000)
            for _ in range(length - length // 2)] for _ in range(requests)]  # fmt: skip


def run_cache(prompts: list[list[int]], track: bool) -> tuple[float, int]:
    cache = RadixCache(CacheConfig(max_total_tokens=CAPACITY))
    tracker = BlockTracker(cache, BLOCK) if track else None
    events, slot = 0, 0
    t0 = time.process_time()
    for p in prompts:
        cache.match_prefix(p)
        cache.insert(p, range(slot, slot + len(p)))
        slot += len(p)
        over = cache.total_size() - CAPACITY
        if over > 0:
            cache.evict(over)
        if tracker is not None:
            events += len(tracker.take())
    return time.process_time() - t0, events


def bench_tracker(args: argparse.Namespace) -> None:
    prompts = workload(args.requests, args.prompt)
    base, ours, events = [], [], 0
    for _ in range(args.repeats):
        base.append(run_cache(prompts, False)[0])
        t, events = run_cache(prompts, True)
        ours.append(t)
    b, o = statistics.median(base), statistics.median(ours)
    print(f"tracker: {args.requests} requests of {args.prompt} tokens, {GROUPS} prefix groups, "
          f"capacity {CAPACITY} tokens, block {BLOCK}")  # fmt: skip
    print(f"  cache alone       {b * 1e3:8.1f} ms  ({args.requests / b:,.0f} requests/s)")
    print(f"  cache + tracker   {o * 1e3:8.1f} ms  ({args.requests / o:,.0f} requests/s), "
          f"{events} events")  # fmt: skip
    print(f"  overhead ratio    {o / b:.2f}x the cache alone (median of {args.repeats})")


def batches(n_batches: int, per_batch: int) -> list[list]:
    ev = BlockStored([random.getrandbits(64)], random.getrandbits(64), list(range(BLOCK)), BLOCK)
    return [[ev] * per_batch for _ in range(n_batches)]


def receive(endpoint: str, count: int, out: list[float], ready: threading.Event) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.rcvhwm = 0
    sub.connect(endpoint)
    sub.subscribe(b"")
    ready.set()
    got = 0
    while got < count:
        if sub.poll(5000) == 0:
            break
        sub.recv_multipart()
        got += 1
    out.append(time.perf_counter())
    sub.close(0)


def send_ours(evs: list[list]) -> float:
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", hwm=0, max_queue_size=len(evs) + 10)
    plane = KVEventPlane(cfg, RadixCache())
    return timed_send(plane.publisher.endpoint, len(evs), lambda: _feed(plane, evs), plane.close)


def _feed(plane: KVEventPlane, evs: list[list]) -> None:
    for batch in evs:
        plane.tracker.pending.extend(batch)
        plane.flush()


def send_bare(evs: list[list]) -> float:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    payloads = [msgpack.packb([time.time(), [e.wire() for e in b], 0]) for b in evs]

    def feed() -> None:
        for i, p in enumerate(payloads):
            pub.send_multipart((b"", i.to_bytes(8, "big"), p))

    return timed_send(f"tcp://127.0.0.1:{port}", len(evs), feed, lambda: pub.close(0))


def timed_send(endpoint: str, count: int, feed, close) -> float:
    done: list[float] = []
    ready = threading.Event()
    th = threading.Thread(target=receive, args=(endpoint, count, done, ready))
    th.start()
    ready.wait()
    time.sleep(0.3)  # let the subscription reach the publisher
    t0 = time.perf_counter()
    feed()
    th.join()
    close()
    return done[0] - t0


def bench_publisher(args: argparse.Namespace) -> None:
    evs = batches(args.batches, args.per_batch)
    n = args.batches * args.per_batch
    ours, bare = [], []
    for _ in range(args.repeats):
        bare.append(send_bare(evs))
        ours.append(send_ours(evs))
    o, b = statistics.median(ours), statistics.median(bare)
    print(f"publisher: {args.batches} batches of {args.per_batch} BlockStored events "
          f"(block {BLOCK}), loopback TCP to a SUB in another thread")  # fmt: skip
    print(f"  bare PUB socket (pre-encoded)  {n / b:12,.0f} events/s")
    print(f"  KVEventPlane (encode + thread) {n / o:12,.0f} events/s")
    print(f"  ratio                          {b / o:.2f}x the bare socket's rate "
          f"(median of {args.repeats})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--per-batch", type=int, default=8)
    args = ap.parse_args()
    print(machine_line())
    bench_tracker(args)
    bench_publisher(args)


if __name__ == "__main__":
    main()
