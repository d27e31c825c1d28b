"""`route --kv-index mooncake://` in front of three `serve --sim` workers that write their prompts'
pages to a real Mooncake Store (master + store process) as placeholders under the real keys
(issue 28, items 1 and 3): all real processes, real HTTP. What the router expected is read from
its /metrics; where each request went from /workers."""

from __future__ import annotations

import json
import time

import pytest

from mooncake_harness import MooncakeCluster, backend_ports, pin_this_process
from radixserve.router.kvindex.mooncake_client import KvsMetadataConfig, MooncakeMetadataClient
from radixserve.router.kvindex.mooncake_meta import present_prefix, store_keys
from server_harness import ServerProcess
from test_router_fleet import RouterProc
from test_router_kv_procs import events_config, free_port, healthy, wait_for

pytest.importorskip("httptools")

CHUNK = 16
PREFIX = list(range(100, 100 + 10 * CHUNK))  # 160 tokens: 10 store chunks


@pytest.fixture(scope="module")
def cluster():
    c = MooncakeCluster()
    yield c
    c.stop()


def sim_worker(
    cluster: MooncakeCluster, ports: tuple[int, int, int] | None = None
) -> ServerProcess:
    """A `serve --sim` worker writing to the store; `ports` (HTTP, events, replay): fixed, so
    that a restart comes back where the router knows it."""
    store = {"backend": "mooncake", "master_server_address": cluster.master_rpc,
             **backend_ports(cluster.client_env()), "chunk_size": CHUNK}  # fmt: skip
    fixed = ["--port", str(ports[0])] if ports else []
    return ServerProcess(["--sim", "tiny-cpu", "--max-total-tokens", "4096", *fixed,
                          "--kv-events-config", events_config(*(ports or (0, 0, 0))[1:]),
                          "--sim-kv-store", json.dumps(store)])  # fmt: skip


def generate(target, ids: list[int]) -> int:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    if isinstance(target, RouterProc):
        return target.call("POST", "/generate", body)[0]
    return target.post("/generate", body).status


def routed(router: RouterProc, ids: list[int]) -> tuple[dict[str, float], str]:
    """Send `ids` through the router: (the change of its kv metrics, the chosen worker's url)."""
    before, sent = router.metrics(), router.requests_per_worker()
    assert generate(router, ids) == 200
    after, now = router.metrics(), router.requests_per_worker()
    [url] = [u for u in now if now[u] != sent.get(u)]
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}, url


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in reversed(started):
        if p.proc.poll() is None:
            p.stop(check=False) if isinstance(p, ServerProcess) else p.stop()


def test_store_holdings_route_and_survive_their_writer(cluster, procs):
    pin_this_process()
    workers = [sim_worker(cluster) for _ in range(3)]
    procs.extend(workers)
    a = workers[0]
    info = a.get("/get_server_info").json()["kv_store"]
    assert info["segment"] is None and info["chunk_size"] == CHUNK  # pages go to the store
    # computed on worker A alone, before any router: A writes the chunks, off the request path
    assert generate(a, PREFIX) == 200
    keys = store_keys(PREFIX, info["namespace"], CHUNK)
    client = MooncakeMetadataClient(KvsMetadataConfig(cluster.metrics_addr))
    wait_for(lambda: present_prefix(client.query(keys) or []) == len(keys), "A's pages stored")
    client.close()

    router = RouterProc([w.url for w in workers], "--policy", "kv_aware",
                        "--kv-index", f"mooncake://{cluster.metrics_addr}",
                        "--kvs-chunk-size", str(CHUNK), "--cache-aware-scheduling-min-tokens",
                        "64", "--kvs-metadata-service-down-duration-s", "1",
                        "--kvs-retry-times", "1", "--kvs-retry-interval-ms", "10")  # fmt: skip
    procs.append(router)
    wait_for(lambda: router.metrics().get("kvs_workers") == 3, "the workers' store segments")
    # A holds it on device (its KV events say so): A, nothing to load
    wait_for(lambda: router.metrics().get(f"kv_index_blocks@{a.url}", 0) >= 10, "A's blocks")
    delta, url = routed(router, PREFIX + [7] * 20)
    assert url == a.url and delta["kvs_lookups_total"] == 1
    assert delta["kv_expected_hit_tokens_total"] == len(PREFIX)
    assert delta["kv_expected_loaded_tokens_total"] == 0

    # A's device pool forgets it; the store does not: whoever gets it loads the whole prefix
    assert a.post("/flush_cache", b"").status == 200
    wait_for(lambda: router.metrics().get(f"kv_index_blocks@{a.url}", -1) == 0, "A flushed")
    delta, url = routed(router, PREFIX + [8] * 20)
    assert delta["kv_expected_hit_tokens_total"] == 0
    assert delta["kv_expected_loaded_tokens_total"] == len(PREFIX)

    # the writer is gone and no device holds the prefix; its pages live in the store process:
    # they still count
    a.stop(check=False)
    for w in workers[1:]:
        assert w.post("/flush_cache", b"").status == 200
        wait_for(lambda w=w: router.metrics().get(f"kv_index_blocks@{w.url}", 0) == 0, "flush")
    delta, url = routed(router, PREFIX + [9] * 20)
    assert url != a.url and delta["kv_expected_loaded_tokens_total"] == len(PREFIX)

    # master down: no client error, routing falls back, kvs_up 0; back after the down duration
    cluster.kill_master()
    try:
        delta, url = routed(router, PREFIX + [20] * 20)
        assert delta["kv_expected_loaded_tokens_total"] == 0
        assert delta["kvs_fallback_decisions_total"] == 1 and router.metrics()["kvs_up"] == 0
        delta, _ = routed(router, PREFIX + [21] * 20)  # within the down duration: not asked
        assert delta["kvs_lookup_failures_total"] == 0 and delta["kvs_fallback_decisions_total"]
    finally:
        cluster.start_master()
        cluster.wait_store_mounted()
    time.sleep(1.1)
    delta, _ = routed(router, PREFIX + [22] * 20)
    assert delta["kvs_lookups_total"] == 1 and router.metrics()["kvs_up"] == 1


def test_a_restarted_writer_s_store_keys_still_count(cluster, procs):
    """Worker A computes a prefix (its pages go to the store process) and restarts on the same
    address with an empty device pool: the router, which followed A's first life, drops A's
    device holdings yet still expects the whole prefix to be loaded from the store."""
    pin_this_process()
    ports = (free_port(), free_port(), free_port())
    a, b = sim_worker(cluster, ports), sim_worker(cluster)
    procs.extend([a, b])
    prefix = [p + 7000 for p in PREFIX]  # not the other test's: its pages may still be there
    assert generate(a, prefix) == 200
    keys = store_keys(prefix, a.get("/get_server_info").json()["kv_store"]["namespace"], CHUNK)
    client = MooncakeMetadataClient(KvsMetadataConfig(cluster.metrics_addr))
    wait_for(lambda: present_prefix(client.query(keys) or []) == len(keys), "A's pages stored")
    client.close()
    router = RouterProc([a.url, b.url], "--policy", "kv_aware",
                        "--kv-index", f"mooncake://{cluster.metrics_addr}",
                        "--kvs-chunk-size", str(CHUNK), "--cache-aware-scheduling-min-tokens",
                        "64")  # fmt: skip
    procs.append(router)
    wait_for(lambda: router.metrics().get("kvs_workers") == 2, "the workers' store segments")
    wait_for(lambda: router.metrics().get(f"kv_index_blocks@{a.url}", 0) >= 10, "A's blocks")
    a.stop(check=False)
    again = sim_worker(cluster, ports)
    procs.append(again)
    assert generate(again, [5] * 40) == 200  # the new life publishes from seq 0 again
    wait_for(lambda: router.metrics().get(f"kv_index_blocks@{a.url}", 99) < 10, "A's new life")
    wait_for(lambda: healthy(router, a.url), "the router to see A healthy again")
    delta, _ = routed(router, prefix + [9] * 20)
    assert delta["kv_expected_hit_tokens_total"] == 0
    assert delta["kv_expected_loaded_tokens_total"] == len(prefix)


# ----- the simulated workers' store writes, without Mooncake -------------------------------------


def test_sim_writer_stores_whole_chunks_under_page_keys(tmp_path):
    from radixserve.cache.hashing import page_keys
    from radixserve.engine.sim_store import SimStoreWriter
    from radixserve.kvstore.backends import create_backend
    from radixserve.kvstore.storage import PageFormat

    writer = SimStoreWriter({"backend": "file", "path": str(tmp_path), "chunk_size": 32},
                            "tiny-cpu", 16)  # fmt: skip
    ids = list(range(7, 7 + 100))  # 3 whole chunks of 32, and 4 tokens more
    writer.submit(ids)
    writer.submit(ids[:20])  # shorter than a chunk: nothing to write
    writer.close()
    keys = page_keys(ids, writer.namespace, 32)
    assert len(keys) == 3 and writer.pages_written == 3 and writer.failed == 0
    reader = create_backend("file", PageFormat(writer.digest, 64), {"path": str(tmp_path)})
    assert reader.exists_prefix(keys) == 3
    assert writer.info()["namespace"] == writer.digest and writer.info()["segment"] is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sim-kv-store", "{}"], "needs --sim"),
        (["--sim", "tiny-cpu", "--sim-kv-store", "[1]"], "JSON object"),
        (["--sim", "tiny-cpu", "--sim-kv-store", '{"backend": "nfs"}'], "mooncake or file"),
        (["--sim", "tiny-cpu", "--sim-kv-store", '{"chunk_size": 0}'], "chunk_size"),
    ],
)
def test_bad_sim_kv_store_is_one_line(flags, message):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--port", "0", *flags],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
