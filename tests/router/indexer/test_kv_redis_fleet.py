"""The shared KV index end to end, every part a real process: redis-server, `serve --sim`
workers publishing KV events, `radixserve kv-indexer`, and `route --policy kv_aware --kv-index
redis://` replicas. Replicas agree and a late one routes precisely at once; Redis killed,
the indexer killed, a worker killed: no client error, and the index converges again."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("httptools")
redis = pytest.importorskip("redis")

from radixserve.router.kvindex.block_index import chain_keys  # noqa: E402
from radixserve.router.kvindex.redis_store import block_id  # noqa: E402
from radixserve.router.proxy.workers import ConnectionPool  # noqa: E402
from redis_harness import RedisServer  # noqa: E402
from test_router_fleet import Proc, RouterProc, WorkerProc  # noqa: E402

BLOCK = 16
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                     "block_size": BLOCK, "buffer_steps": 4})  # fmt: skip
# a replay buffer too short to rebuild a worker from: what the indexer knows of a worker it
# (re)joins comes from the worker's snapshot
FAST = ("--health-check-interval-secs", "0.2", "--retry-backoff-ms", "5")
GATE = ("--kvs-retry-times", "2", "--kvs-retry-interval-ms", "20",
        "--kvs-metadata-service-down-duration-s", "1")  # fmt: skip


class IndexerProc(Proc):
    def __init__(self, urls: list[str], redis_url: str) -> None:
        cmd = [sys.executable, "-m", "radixserve", "kv-indexer", "--port", "0", "--redis",
               redis_url, "--health-check-interval-secs", "0.2", "--worker-urls", *urls]  # fmt: skip
        super().__init__(cmd)
        self.url = self.wait_line(r"admin on (http://\S+)").group(1)

    def call(self, method: str, path: str, obj: object = None) -> tuple[int, dict]:
        data = None if obj is None else json.dumps(obj).encode()
        req = urllib.request.Request(self.url + path, data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


def launch_worker() -> WorkerProc:
    cmd = [sys.executable, "-m", "radixserve", "serve", "--sim", "tiny-cpu", "--port", "0",
           "--log-level", "warning", "--kv-events-config", EVENTS]  # fmt: skip
    worker = WorkerProc(cmd)
    worker.url = worker.wait_line(r"serving \S+ on (http://\S+)").group(1)
    return worker


@pytest.fixture(scope="module")
def fleet():
    """redis-server, two publishing workers and an indexer, shared by the tests (a test that
    kills one of them starts it again); routers are started by the tests."""
    server = RedisServer()
    workers = [launch_worker(), launch_worker()]
    procs: list[Proc] = list(workers)
    indexer = IndexerProc([w.url for w in workers], server.url)
    state = {"redis": server, "workers": workers, "indexer": indexer, "procs": procs}
    yield state
    for proc in [*state["procs"], state["indexer"]]:
        proc.stop()
    server.stop()


def router(fleet, *flags: str) -> RouterProc:
    urls = [w.url for w in fleet["workers"]]
    proc = RouterProc(urls, "--policy", "kv_aware", "--kv-index", fleet["redis"].url, *FAST, *flags)
    fleet["procs"].append(proc)
    return proc


def prompt(seed: int, n: int = 6 * BLOCK) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(10, 30000) for _ in range(n)]


def generate(base: str, ids: list[int], max_new: int = 2) -> int:
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}})
    req = urllib.request.Request(base + "/generate", body.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.loads(resp.read())["output_ids"]
        return resp.status


def routed_to(proc: RouterProc, ids: list[int], max_new: int = 2) -> str:
    """The worker URL that `proc` sent this request to."""
    before = proc.requests_per_worker()
    assert generate(f"http://{proc.addr}", ids, max_new) == 200
    after = proc.requests_per_worker()
    (url,) = [u for u in after if after[u] != before.get(u)]
    return url


def loads(proc: RouterProc) -> dict[str, int]:
    return {w["url"]: w["load"] for w in proc.call("GET", "/get_loads")[1]["workers"]}


def wait_for(cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.05)


def redis_holders(fleet, ids: list[int]) -> dict[str, int]:
    """Workers that Redis says hold the first block of `ids`."""
    client = redis.Redis.from_url(fleet["redis"].url)
    try:
        key = chain_keys(None, ids[:BLOCK], BLOCK)[0]
        numbers = {int(n) for n in client.smembers("radixserve:b:" + block_id(key))}
        urls = {int(n): u.decode() for n, u in client.hgetall("radixserve:wurl").items()}
        return {urls[n]: n for n in numbers if n in urls}
    finally:
        client.close()


def test_replicas_agree_and_a_late_one_routes_precisely_at_once(fleet):
    urls = [w.url for w in fleet["workers"]]
    a, b = router(fleet), router(fleet)
    p1, p2, p3 = prompt(1), prompt(2), prompt(3)
    # p1 goes through A; then p2, while a long request on p1's worker (p1 and one block more,
    # so A sends it to p1's holder: a hold of at most half a prompt is no preference) keeps that
    # one busy: A sends p2 to the other, so the prefixes live apart
    w1 = routed_to(a, p1)
    w2 = next(u for u in urls if u != w1)
    # under load the events can lag: until Redis has p1 at w1, A has no holder to prefer
    wait_for(lambda: w1 in redis_holders(fleet, p1), what=f"{w1} in Redis for p1")
    busy = threading.Thread(target=generate, args=(f"http://{a.addr}", p1 + prompt(9, BLOCK), 2000))
    busy.start()
    try:
        try:
            wait_for(lambda: loads(a)[w1] == 1, what="a request in flight on w1")
        except AssertionError as exc:  # say where it went and what the router saw
            raise AssertionError(f"{exc}; loads {loads(a)}\n{warnings(a)}") from None
        assert routed_to(a, p2) == w2
    finally:
        busy.join()
    generate(w2, p3)  # p3 reaches w2 without any router: only the events can tell
    for ids, holder in ((p1, w1), (p2, w2), (p3, w2)):
        wait_for(lambda i=ids, h=holder: h in redis_holders(fleet, i), what=f"{holder} in Redis")
    # replica B never saw p1 or p2 and sends them on to the holder, with another suffix
    assert routed_to(b, p1 + prompt(11, BLOCK)) == w1
    assert routed_to(b, p2 + prompt(12, BLOCK)) == w2
    late = router(fleet)  # started now: no history of its own, and still precise at once
    assert routed_to(late, p3 + prompt(13, BLOCK)) == w2
    assert routed_to(late, p2) == w2
    # Redis keeps no per-worker removal counts: no eviction counter that would always read 0
    assert not [k for k in late.metrics() if k.startswith("kv_index_removed_blocks")]


def warnings(proc: RouterProc) -> str:
    """The router's warnings so far (health checks failed, Redis marked down, retries): what
    a failed routing assertion needs beside the lists it compares."""
    return "router warnings:\n" + "".join(line for line in proc.lines if " WARNING " in line)


def queued(proc: RouterProc) -> dict[str, tuple[int | None, int | None]]:
    """Per worker: the prefill tokens it last reported waiting, and what the router counts."""
    rows = proc.call("GET", "/get_loads")[1]["workers"]
    return {
        w["url"]: (w.get("reported_prefill_tokens"), w.get("pending_prefill_tokens")) for w in rows
    }


def metric(proc: RouterProc, name: str) -> float:
    with urllib.request.urlopen(f"http://{proc.addr}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f"radixserve_router_{name} "):
                return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


class Load:
    """Requests in a background thread until stopped; every status is kept."""

    def __init__(self, proc: RouterProc) -> None:
        self.addr, self.statuses, self.stop = proc.addr, [], threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        pool, i = ConnectionPool(f"http://{self.addr}"), 0
        while not self.stop.is_set():
            ids = prompt(100 + i % 8) + prompt(1000 + i, 4)
            body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
            try:
                resp = await pool.request("POST", "/generate", body.encode(), timeout=60)
                self.statuses.append(resp.status)
            except (ConnectionError, TimeoutError) as exc:
                self.statuses.append(type(exc).__name__)
            i += 1
        pool.close()

    def finish(self) -> list:
        self.stop.set()
        self.thread.join(60)
        return self.statuses


def test_redis_killed_under_load_falls_back_then_returns_to_precise(fleet):
    proc, w2 = router(fleet, *GATE), fleet["workers"][1].url
    p0 = prompt(20)
    generate(w2, p0)  # in Redis before it dies; only the indexer's rewrite can bring it back
    wait_for(lambda: w2 in redis_holders(fleet, p0), what="p0 in Redis")
    load = Load(proc)
    wait_for(lambda: len(load.statuses) >= 10, what="load")
    fleet["redis"].kill()
    wait_for(lambda: metric(proc, "kvs_up") == 0, what="kvs marked down")
    n = len(load.statuses)
    wait_for(lambda: len(load.statuses) >= n + 10, what="requests served while Redis is down")
    assert metric(proc, "kvs_fallback_decisions_total") > 0
    fleet["redis"].start()  # empty: the indexer rewrites it from its own view
    p = prompt(21, 40 * BLOCK)  # long: the last check's pick holds >= 95%, never spilled
    generate(w2, p)
    wait_for(lambda: w2 in redis_holders(fleet, p), what="new events in the new Redis")
    wait_for(lambda: w2 in redis_holders(fleet, p0), what="the index rewritten into Redis")
    lookups = metric(proc, "kvs_lookups_total")  # tried again after the 1 s down duration:
    wait_for(lambda: metric(proc, "kvs_lookups_total") > lookups + 5, what="lookups again")
    assert set(load.finish()) == {200}
    assert routed_to(proc, p + prompt(22, 1)) == w2, warnings(proc)  # precise: only Redis knows p
    assert metric(proc, "kvs_up") == 1


def test_redis_killed_the_fallback_sends_each_prefix_group_to_its_holder(fleet):
    """Issue 25: the approximate tree is kept from the router's dispatches while Redis serves,
    so when Redis dies the first request of each prefix group still goes to the worker that
    holds it (a cold tree sent about half of them to a worker without it)."""
    proc, w2 = router(fleet, *GATE), fleet["workers"][1].url
    seen = prompt(590)
    generate(w2, seen)  # only Redis can tell the router where this prompt is
    wait_for(lambda: w2 in redis_holders(fleet, seen), what="the prompt in Redis")
    suffix = iter(range(20_000, 30_000))
    wait_for(lambda: routed_to(proc, seen + [next(suffix)]) == w2, what="precise from Redis")
    groups = [prompt(600 + g) for g in range(8)]
    queues = queued(proc)  # a worker's report outliving the request it counted showed here
    holders = [routed_to(proc, ids + prompt(700 + g, BLOCK)) for g, ids in enumerate(groups)]
    why = f"{warnings(proc)}queued prefill before the groups: {queues}"
    assert set(holders) == {w.url for w in fleet["workers"]}, why  # a wrong pick shows
    for ids, holder in zip(groups, holders):
        wait_for(lambda i=ids, h=holder: h in redis_holders(fleet, i), what=f"{holder} in Redis")
    fallbacks = metric(proc, "kvs_fallback_decisions_total")
    fleet["redis"].kill()
    try:
        after = [routed_to(proc, ids + prompt(800 + g, BLOCK)) for g, ids in enumerate(groups)]
        without_redis = metric(proc, "kvs_fallback_decisions_total") - fallbacks
    finally:
        fleet["redis"].start()  # empty: the indexer rewrites it for the tests that follow
    assert without_redis == len(groups), warnings(proc)
    assert after == holders, warnings(proc)


def index_matches_snapshots(fleet) -> bool:
    """Redis holds, per worker, exactly the blocks its own snapshot lists (keys recomputed)."""
    client = redis.Redis.from_url(fleet["redis"].url)
    try:
        table = {u.decode(): json.loads(m) for u, m in client.hgetall("radixserve:workers").items()}
        for worker in fleet["workers"]:
            with urllib.request.urlopen(worker.url + "/kv_events/snapshot", timeout=10) as r:
                snap = json.loads(r.read())
            keys: dict[int, int] = {}
            for blk in snap["blocks"]:
                parent = keys.get(blk["parent_block_hash"])
                keys[blk["block_hash"]] = chain_keys(parent, blk["token_ids"], BLOCK)[0]
            held = {}
            if worker.url in table:
                raw = client.hgetall(f"radixserve:m:{table[worker.url]['n']}")
                held = {int(e): int(k, 16) for e, k in raw.items()}
            if held != keys:
                return False
        return True
    finally:
        client.close()


def flush(url: str) -> None:
    """/flush_cache, retried while the worker is busy (409)."""

    def done() -> bool:
        req = urllib.request.Request(url + "/flush_cache", b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status == 200
        except urllib.error.HTTPError as err:
            assert err.code == 409, err.code
            return False

    wait_for(done, what="an idle moment to flush")


def test_indexer_killed_and_restarted_under_load_converges(fleet):
    proc, w1 = router(fleet, *GATE), fleet["workers"][0].url
    load = Load(proc)
    wait_for(lambda: len(load.statuses) >= 10, what="load")
    fleet["indexer"].kill()
    # while nobody listens, w1 forgets everything and caches q, then enough else that its
    # replay buffer no longer reaches q: only its snapshot can tell the new indexer
    flush(w1)
    q = prompt(41)
    for ids in [q, *(prompt(42 + j) for j in range(6))]:
        generate(w1, ids)
    n = len(load.statuses)
    wait_for(lambda: len(load.statuses) >= n + 10, what="requests served without an indexer")
    fleet["indexer"] = IndexerProc([w.url for w in fleet["workers"]], fleet["redis"].url)
    n = len(load.statuses)
    wait_for(lambda: len(load.statuses) >= n + 10, what="requests after the restart")
    assert set(load.finish()) == {200}
    wait_for(lambda: index_matches_snapshots(fleet), what="Redis equal to the workers' snapshots")
    assert w1 in redis_holders(fleet, q)


def test_workers_added_removed_and_killed_leave_redis(fleet):
    indexer, extra = fleet["indexer"], launch_worker()
    fleet["procs"].append(extra)
    generate(extra.url, prompt(31))  # cached before the indexer follows it: the snapshot has it
    assert indexer.call("POST", "/workers", {"url": extra.url})[0] == 201
    status, body = indexer.call("POST", "/workers", {"url": extra.url})
    assert status == 409 and body["error"]["code"] == "conflict"  # a string, as the router's
    assert indexer.call("POST", "/workers", {"url": extra.url, "x": 1})[0] == 400
    wait_for(lambda: extra.url in redis_holders(fleet, prompt(31)), what="snapshot resync")
    assert indexer.call("DELETE", "/workers/" + extra.url)[0] == 200
    wait_for(lambda: extra.url not in redis_holders(fleet, prompt(31)), what="removed worker gone")
    assert indexer.call("POST", "/add_worker?url=" + extra.url)[0] == 200
    wait_for(lambda: extra.url in redis_holders(fleet, prompt(31)), what="added again")
    extra.kill()
    client = redis.Redis.from_url(fleet["redis"].url)
    try:
        wait_for(lambda: not client.hexists("radixserve:workers", extra.url), what="dead worker")
        assert extra.url not in redis_holders(fleet, prompt(31))
        # a worker that dies while no indexer runs leaves Redis when the next one starts
        other = launch_worker()
        fleet["procs"].append(other)
        generate(other.url, prompt(32))
        assert indexer.call("POST", "/workers", {"url": other.url})[0] == 201
        wait_for(lambda: other.url in redis_holders(fleet, prompt(32)), what="other indexed")
        indexer.kill()
        other.kill()
        urls = [*(w.url for w in fleet["workers"]), other.url]
        fleet["indexer"] = IndexerProc(urls, fleet["redis"].url)
        wait_for(lambda: not client.hexists("radixserve:workers", other.url), what="dead at start")
        assert other.url not in redis_holders(fleet, prompt(32))
    finally:
        client.close()


def test_indexer_admin_api_answers_health_metrics_and_errors(fleet):
    """The kv-indexer's admin API (the router's own HTTP code and prometheus-client): health,
    one Prometheus family per metric with a sample per followed worker, clear 404/405."""
    from prometheus_client.parser import text_string_to_metric_families

    indexer = fleet["indexer"]
    status, body = indexer.call("GET", "/health")
    assert status == 200 and body["redis"] is True and body["workers"] >= 2
    with urllib.request.urlopen(indexer.url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        families = list(text_string_to_metric_families(resp.read().decode()))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family per name (a scraper refuses duplicates)
    by_name = {f.name: f for f in families}
    workers = {s.labels["worker"] for s in by_name["radixserve_kv_indexer_blocks"].samples}
    assert {w.url for w in fleet["workers"]} <= workers
    assert by_name["radixserve_kv_indexer_redis_up"].samples[0].value == 1
    assert indexer.call("GET", "/nowhere")[0] == 404
    assert indexer.call("DELETE", "/health")[0] == 405
