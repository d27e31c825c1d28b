"""Where prefixes live, asked of Mooncake's master: the pure parser on answers captured from the
real master (tests/fixtures, named by version), and the client's retry and down-gating against a
real master that is killed and restarted."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest

from mooncake_harness import MooncakeCluster, backend_ports, pin_this_process
from radixserve.cache.hashing import block_hashes
from radixserve.kvstore.backends import create_backend
from radixserve.kvstore.storage import PageFormat
from radixserve.router.kvindex.mooncake_client import KvsMetadataConfig, MooncakeMetadataClient
from radixserve.router.kvindex.mooncake_meta import (
    NOT_QUERIED,
    SHARED,
    KeyLocation,
    MetadataAnswerError,
    Replica,
    loadable_prefix,
    parse_batch_query,
    prefix_by_holder,
    present_prefix,
    query_chunks,
    query_path,
)

FIXTURE = json.loads(
    (Path(__file__).parents[1] / "fixtures/mooncake_batch_query_keys.json").read_text()
)


def test_fixture_names_the_version_it_was_captured_from():
    assert FIXTURE["version"] == "mooncake-transfer-engine-non-cuda 0.3.13.post1"


def test_parse_real_answer_maps_keys_to_their_holders():
    keys, store = FIXTURE["keys"], FIXTURE["store_endpoint"]
    engine = next(e for e in FIXTURE["endpoints"] if e != store)
    locs = parse_batch_query(json.dumps(FIXTURE["answer"]), keys)
    assert present_prefix(locs) == FIXTURE["present_prefix"] == 4
    assert [loc.ok for loc in locs] == [True] * 4 + [False] * 2
    assert locs[4].error == "OBJECT_NOT_FOUND" and locs[4].replicas == ()
    assert {r.medium for loc in locs[:4] for r in loc.replicas} == {"memory"}
    assert len(locs[3].replicas) == 2  # replica_num=2: one on each segment
    holders = [{r.endpoint for r in loc.replicas} for loc in locs[:4]]
    runs = prefix_by_holder(locs)
    # each holder's run is exactly its contiguous prefix in the captured placement
    for holder in (store, engine):
        n = 0
        while n < 4 and holder in holders[n]:
            n += 1
        assert runs.get(holder, 0) == n
    assert set(runs) <= {store, engine}


def test_loadable_prefix_counts_the_store_process_for_every_worker():
    keys, store = FIXTURE["keys"], FIXTURE["store_endpoint"]
    engine = next(e for e in FIXTURE["endpoints"] if e != store)
    locs = parse_batch_query(json.dumps(FIXTURE["answer"]), keys)
    on_engine_only = [i for i, loc in enumerate(locs[:4])
                      if {r.endpoint for r in loc.replicas} == {engine}]  # fmt: skip
    first_gap = on_engine_only[0] if on_engine_only else 4
    got = loadable_prefix(locs, {"A": engine, "B": None, "C": "127.0.0.1:1"}, shared=[store])
    assert got == {"A": 4, "B": first_gap, "C": first_gap}
    assert loadable_prefix(locs, {"A": engine}) == {"A": prefix_by_holder(locs).get(engine, 0)}


def test_parse_is_by_key_not_by_position():
    keys = FIXTURE["keys"]
    answer = FIXTURE["answer"]
    shuffled = {"success": True, "data": dict(reversed(list(answer["data"].items())))}
    assert parse_batch_query(json.dumps(shuffled), keys) == parse_batch_query(
        json.dumps(answer), keys
    )
    assert parse_batch_query(json.dumps(answer), keys[::-1])[0].ok is False


@pytest.mark.parametrize("body, match", [
    (b"<html>", "not JSON"),
    (json.dumps({"success": False, "error": "No keys provided"}), "refused the query"),
    (json.dumps({"success": True}), "no 'data' map"),
    (json.dumps({"success": True, "data": {}}), "lacks 6 queried key"),
])  # fmt: skip
def test_parse_refuses_answers_that_are_not_the_documented_shape(body, match):
    with pytest.raises(MetadataAnswerError, match=match):
        parse_batch_query(body, FIXTURE["keys"])


def test_malformed_replica_is_refused():
    key = FIXTURE["keys"][0]
    bad = {"success": True, "data": {key: {"ok": True, "values": [{"size_": 1}]}}}
    with pytest.raises(MetadataAnswerError, match="transport_endpoint_"):
        parse_batch_query(json.dumps(bad), [key])


def test_prefix_by_holder_counts_shared_replicas_for_everyone():
    a, b = Replica("A", "memory", 1), Replica("B", "memory", 1)
    shared = Replica(SHARED, "disk", 1)
    locs = [KeyLocation(True, (a, b)), KeyLocation(True, (shared,)), KeyLocation(True, (a,)),
            KeyLocation(False, (), "OBJECT_NOT_FOUND"), KeyLocation(True, (a, b))]  # fmt: skip
    assert prefix_by_holder(locs) == {"A": 3, "B": 2}
    assert present_prefix(locs) == 3
    assert prefix_by_holder([KeyLocation(True, (shared,)), KeyLocation(True, (b,))]) == {
        SHARED: 1,
        "B": 2,
    }


def test_query_path_refuses_keys_the_master_would_split():
    assert query_path(["ab", "cd"]) == "/batch_query_keys?keys=ab,cd"
    for bad in ([], ["a,b"], [""]):
        with pytest.raises(ValueError):
            query_path(bad)


def test_query_chunks_bound_every_request():
    keys = [f"rkv1-0123456789abcdef_{i:064x}" for i in range(600)]  # f's key shape, 86 chars
    chunks = query_chunks(keys, 4096)
    assert [k for c in chunks for k in c] == keys and len(chunks) > 10
    assert all(len(query_path(c)) <= 4096 for c in chunks)
    assert query_chunks(keys[:3]) == [keys[:3]]
    with pytest.raises(ValueError, match="does not fit"):
        query_chunks(["k" * 5000], 4096)


# --- the client against a real master ----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    c = MooncakeCluster()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stored(cluster):
    """Three pages written through the storage backend: the keys and the store's endpoint."""
    fmt = PageFormat("model=m", 1024)
    cfg = {"master_server_address": cluster.master_rpc, **backend_ports(pin_this_process())}
    b = create_backend("mooncake", fmt, cfg)
    keys = block_hashes(list(range(16 * 5)), 16, "sha256_cbor", namespace="model=m")
    assert b.put_pages(keys[:3], [bytes(1024)] * 3) == 3
    yield keys
    b.close()


def test_client_maps_keys_to_the_store_segment(cluster, stored):
    client = MooncakeMetadataClient(KvsMetadataConfig(cluster.metrics_addr))
    locs = client.query(stored)
    assert present_prefix(locs) == 3
    assert prefix_by_holder(locs) == {cluster.store_endpoint: 3}
    assert asyncio.run(_aquery(client, stored)) == locs
    assert client.stats.queries == 2 and client.stats.failures == 0
    client.close()


async def _aquery(client, keys):
    try:
        return await client.aquery(keys)
    finally:
        await client.aclose()


def test_long_prompts_are_asked_in_bounded_requests(cluster):
    """500+ page keys (an 8,000-token prompt) in one query would pass 64 KiB of URL, which HTTP
    clients refuse: the client cuts them into bounded requests and stops at the first chunk
    whose prefix ends."""
    cfg = {"master_server_address": cluster.master_rpc, **backend_ports(pin_this_process())}
    b = create_backend("mooncake", PageFormat("model=long", 64), cfg)
    keys = [f"rkv1-0123456789abcdef_{i:064x}" for i in range(800)]
    assert b.put_pages(keys[:450], [bytes(64)] * 450) == 450
    client = MooncakeMetadataClient(KvsMetadataConfig(cluster.metrics_addr))
    locs = client.query(keys)
    assert len(locs) == 800 and present_prefix(locs) == 450
    assert prefix_by_holder(locs) == {cluster.store_endpoint: 450}
    assert locs[-1].error == NOT_QUERIED  # the chunk with key 450 ended every prefix
    assert asyncio.run(_aquery(client, keys)) == locs
    b.close()


def test_client_retries_then_gates_then_comes_back(cluster, stored, caplog):
    caplog.set_level(logging.INFO, "radixserve.router")
    cfg = KvsMetadataConfig(cluster.metrics_addr, retry_times=5, retry_interval_ms=100,
                            down_duration_s=1.0)  # fmt: skip
    client = MooncakeMetadataClient(cfg)
    cluster.kill_master()
    try:
        t0 = time.monotonic()
        assert client.query(stored) is None  # no exception: the caller routes without the store
        assert client.stats.failures == 6  # one try and five retries
        assert time.monotonic() - t0 >= 0.5  # five 100 ms waits between them
        assert not client.up
        t0 = time.monotonic()
        assert client.query(stored) is None and client.stats.failures == 6  # gated: not tried
        assert time.monotonic() - t0 < 0.05
        other = MooncakeMetadataClient(cfg)  # the asyncio path retries and gates the same way
        assert asyncio.run(_aquery(other, stored)) is None
        assert other.stats.failures == 6 and not other.up
    finally:
        cluster.start_master()
        cluster.wait_store_mounted()
    time.sleep(1.05)
    locs = client.query(stored)
    assert locs is not None and client.up
    assert present_prefix(locs) == 0  # a restarted master knows no key
    assert len([r for r in caplog.records if "down (" in r.getMessage()]) == 2  # one per client
    assert any("is back" in r.getMessage() for r in caplog.records)
    client.close()
