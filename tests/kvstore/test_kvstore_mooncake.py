"""The mooncake storage backend against a real Mooncake Store (master + store process on free
loopback ports): pages outlive the engine that wrote them, foreign bytes are refused, a missing
key cuts the prefix, and a master that dies and restarts costs no exception and comes back."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mooncake_harness import MooncakeCluster, backend_ports, pin_this_process
from radixserve.cache.hashing import block_hashes
from radixserve.kvstore.backends import create_backend
from radixserve.kvstore.mooncake_procs import admin_get
from radixserve.kvstore.storage import PageFormat
from radixserve.router.kvindex.mooncake_meta import parse_batch_query, prefix_by_holder, query_path

NS = "rkv1-smollm2-135m-bf16-p16"  # a KVNamespace digest stand-in
PAGE = 64 << 10


@pytest.fixture(scope="module")
def cluster():
    c = MooncakeCluster()
    yield c
    c.stop()


def backend(cluster, fmt=None, **extra):
    cfg = {
        "master_server_address": cluster.master_rpc,
        **backend_ports(pin_this_process()),
        **extra,
    }
    return create_backend("mooncake", fmt or PageFormat(NS, PAGE), cfg)


def page_keys(tokens: list[int], ns: str = NS) -> list[str]:
    return block_hashes(tokens, 16, "sha256", namespace=ns)


def page(i: int) -> bytes:
    return bytes([i % 251]) * PAGE


WRITER = textwrap.dedent("""
    import json, sys
    from radixserve.kvstore.backends import create_backend
    from radixserve.kvstore.storage import PageFormat
    cfg, ns, size, keys = json.loads(sys.argv[1])
    b = create_backend("mooncake", PageFormat(ns, size), cfg)
    print(b.put_pages(keys, [bytes([i % 251]) * size for i in range(len(keys))]), flush=True)
    b.close()
""")


def test_pages_outlive_the_process_that_wrote_them(cluster):
    keys = page_keys(list(range(1000, 1000 + 16 * 6)))
    cfg = {"master_server_address": cluster.master_rpc, **backend_ports(cluster.client_env())}
    out = subprocess.run([sys.executable, "-c", WRITER, json.dumps([cfg, NS, PAGE, keys])],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "6"  # the writer exited: its client is gone
    reader = backend(cluster)
    bufs = [bytearray(PAGE) for _ in keys]
    assert reader.exists_prefix(keys) == 6
    assert reader.get_pages(keys, bufs) == 6
    assert all(bufs[i] == page(i) for i in range(6))
    # the metadata service names the store process as the holder of every page
    locs = parse_batch_query(admin_get(cluster.metrics_addr, query_path(keys)), keys)
    assert prefix_by_holder(locs) == {cluster.store_endpoint: 6}
    reader.close()


def test_missing_key_mid_batch_uses_only_the_present_prefix(cluster):
    b = backend(cluster)
    keys = page_keys(list(range(2000, 2000 + 16 * 5)))
    assert b.put_pages(keys[:2] + keys[3:], [page(0), page(1), page(3), page(4)]) == 4
    assert b.exists_prefix(keys) == 2
    bufs = [bytearray(PAGE) for _ in keys]
    assert b.get_pages(keys, bufs) == 2
    assert bufs[:2] == [page(0), page(1)] and bufs[3] == bytearray(PAGE)
    b.close()


def test_write_once_keeps_the_first_value(cluster):
    b = backend(cluster)
    key = page_keys(list(range(3000, 3016)))
    assert b.put_pages(key, [page(7)]) == 1
    b.put_pages(key, [page(9)])
    buf = [bytearray(PAGE)]
    assert b.get_pages(key, buf) == 1 and buf[0] == page(7)
    b.close()


def test_wrong_namespace_or_size_is_refused_never_loaded(cluster):
    keys = page_keys(list(range(4000, 4032)))
    writer = backend(cluster)
    assert writer.put_pages(keys, [page(1), page(2)]) == 2
    other_model = backend(cluster, PageFormat("rkv1-llama-3-8b-bf16-p16", PAGE))
    buf = [bytearray(PAGE)]
    assert other_model.get_pages(keys[:1], buf) == 0 and buf[0] == bytearray(PAGE)
    assert other_model.stats.refused["namespace"] == 1
    bigger = backend(cluster, PageFormat(NS, 2 * PAGE))  # a value shorter than this page size
    assert bigger.get_pages(keys[:1], [bytearray(2 * PAGE)]) == 0
    smaller = backend(cluster, PageFormat(NS, PAGE // 2))  # a value longer than its buffer
    assert smaller.get_pages(keys[:1], [bytearray(PAGE // 2)]) == 0
    assert bigger.stats.refused["size"] == 1 and smaller.stats.refused["size"] == 1
    for b in (writer, other_model, bigger, smaller):
        b.close()


def test_master_restart_marks_down_without_exceptions_and_comes_back(cluster, caplog):
    caplog.set_level(logging.INFO, "radixserve.kvstore")
    b = backend(cluster, down_duration_s=1.0)
    keys = page_keys(list(range(5000, 5048)))
    assert b.put_pages(keys, [page(i) for i in range(3)]) == 3
    cluster.kill_master()
    try:
        bufs = [bytearray(PAGE) for _ in keys]
        assert b.exists_prefix(keys) == 0 and not b.available
        assert b.get_pages(keys, bufs) == 0 and b.put_pages(keys, bufs) == 0  # refused at once
        time.sleep(1.1)
        t0 = time.monotonic()
        assert b.exists_prefix(keys) == 0  # after the duration: a probe, not a 4 s RPC
        assert time.monotonic() - t0 < 2.0
    finally:
        cluster.start_master()
        cluster.wait_store_mounted()
    time.sleep(1.1)
    assert b.exists_prefix(keys) == 0  # the master restarted empty: every key is gone
    assert b.available
    assert b.put_pages(keys, [page(i) for i in range(3)]) == 3
    assert b.get_pages(keys, bufs) == 3 and bufs[2] == page(2)
    downs = [r for r in caplog.records if "is down" in r.getMessage()]
    assert len(downs) == 1  # one outage, one line
    assert any("is back" in r.getMessage() for r in caplog.records)
    b.close()


def test_hung_master_costs_the_rpc_timeout_then_is_gated(cluster):
    b = backend(cluster, down_duration_s=1.0, rpc_timeout_ms=1000)
    keys = page_keys(list(range(8000, 8016)))
    assert b.put_pages(keys, [page(1)]) == 1
    os.kill(cluster.master.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert b.exists_prefix(keys) == 0 and not b.available  # -901 after the RPC timeout
        assert b.get_pages(keys, [bytearray(PAGE)]) == 0  # gated: no second wait
        assert time.monotonic() - t0 < 5.0
    finally:
        os.kill(cluster.master.pid, signal.SIGCONT)
    time.sleep(1.1)
    buf = [bytearray(PAGE)]
    assert b.get_pages(keys, buf) == 1 and buf[0] == page(1) and b.available
    b.close()


def test_store_down_at_start_up_serves_without_it_and_retries(cluster, caplog):
    caplog.set_level(logging.INFO, "radixserve.kvstore")
    cluster.kill_master()
    try:
        t0 = time.monotonic()
        b = backend(cluster, down_duration_s=0.5)  # no exception: the engine still starts
        assert time.monotonic() - t0 < 5.0 and not b.available
        keys = page_keys(list(range(6000, 6016)))
        for _ in range(3):
            assert b.put_pages(keys, [page(0)]) == 0 and b.exists_prefix(keys) == 0
        time.sleep(0.6)
        assert b.exists_prefix(keys) == 0
    finally:
        cluster.start_master()
        cluster.wait_store_mounted()
    starts = [r for r in caplog.records if "at start-up" in r.getMessage()]
    assert len(starts) == 1
    time.sleep(0.6)
    assert b.put_pages(keys, [page(5)]) == 1 and b.available
    buf = [bytearray(PAGE)]
    assert b.get_pages(keys, buf) == 1 and buf[0] == page(5)
    b.close()


def test_killed_holder_reads_as_a_miss(cluster):
    """A page held by a client that was killed (not the store process) is a miss, not an error."""
    script = textwrap.dedent("""
        import json, os, sys, time
        os.environ.update(json.loads(sys.argv[2]))
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
        print(s.get_hostname(), flush=True)
        time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script, cluster.master_rpc,
                               json.dumps(cluster.client_env())],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        holder.stdout.readline()
        fmt = PageFormat(NS, PAGE)
        b = backend(cluster)
        # pages land on either segment (random allocation); keep writing until the holder has one
        keys = page_keys(list(range(7000, 7000 + 16 * 24)))
        assert b.put_pages(keys, [page(i) for i in range(len(keys))]) == len(keys)
        locs = parse_batch_query(admin_get(cluster.metrics_addr, query_path(keys)), keys)
        on_holder = [i for i, loc in enumerate(locs)
                     if cluster.store_endpoint not in {r.endpoint for r in loc.replicas}]  # fmt: skip
        assert on_holder, "random allocation put no page on the second segment"
    finally:
        holder.kill()
        holder.wait(10)
    first = on_holder[0]
    bufs = [bytearray(fmt.page_nbytes) for _ in keys]
    assert b.get_pages(keys, bufs) == first  # stops at the dead holder's page, no exception
    assert all(bufs[i] == page(i) for i in range(first))
    b.close()
