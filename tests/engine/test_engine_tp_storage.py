"""The storage tier at ``--tp-size 2`` (two CPU processes over gloo, the file backend): each rank
writes its own KV heads' part of every page under a key naming those heads; with the device and
host tiers flushed (and in a fresh engine), the pages come back from the store and the greedy
tokens are tp 1's; a page one rank lacks its part of is not loaded (recomputed); a rank killed
while the store is in use still takes the engine down with a message. The same round trip
through a real Mooncake master and store process (skipped without the wheel)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_engine_tp import assert_the_dead_rank_is_named  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.cache.hashing import block_hashes  # noqa: E402
from radixserve.kvstore.storage import HEADER  # noqa: E402
from server_harness import ServerProcess  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

CHUNK = 16
rng = random.Random(11)
PROMPT = [rng.randrange(4, 300) for _ in range(71)]
CHUNKS = len(PROMPT) // CHUNK  # whole chunks written
LOADED = (len(PROMPT) - 1) // CHUNK * CHUNK  # whole chunks before the last token: loadable
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """4 attention heads, 2 KV heads: one KV head per rank."""
    return build_tiny_model("llama3", tmp_path_factory.mktemp("tiny-tp-storage"))


@pytest.fixture(scope="module")
def tp1(model_dir) -> dict:
    """The whole model's greedy tokens and logprobs, no tier below the device."""
    e = Engine(model=str(model_dir), max_total_tokens=512, context_length=256)
    try:
        return e.generate(input_ids=PROMPT, sampling_params=SP)
    finally:
        e.shutdown()


def storage_engine(model_dir: Path, store: Path) -> Engine:
    extra = json.dumps({"path": str(store), "chunk_size": CHUNK})
    return Engine(model=str(model_dir), max_total_tokens=512, context_length=256, tp_size=2,
                  enable_hierarchical_cache=True, hicache_storage_backend="file",
                  hicache_storage_backend_extra_config=extra,
                  hicache_storage_prefetch_policy="wait_complete")  # fmt: skip


def wait_written(e: Engine, values: int, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (stats := e.stats())["storage_pages_written"] < values:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


def logprobs(out: dict) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def parts_on_disk(store: Path, parts: list[str]) -> dict[str, dict[str, bytes]]:
    """part -> {the page's key without the part: the stored payload}."""
    out: dict[str, dict[str, bytes]] = {p: {} for p in parts}
    for path in store.rglob("rkv*_*"):
        base, _, part = path.name.rpartition("_")
        out[part][base] = path.read_bytes()[HEADER.size :]
    return out


def test_pages_come_back_from_every_ranks_part_in_the_store(model_dir, tp1, tmp_path) -> None:
    """Engine A writes; with its device and host tiers flushed it loads the pages back. Engine
    B, fresh (every rank's host tier zeros: a rank that did not land its part would attend over
    zeros), loads them too; then, rank 1's part of the second chunk deleted, only the first."""
    store = tmp_path / "kv"
    a = storage_engine(model_dir, store)
    try:
        info = a.procs.info["kv_store"]
        first = a.generate(input_ids=PROMPT, sampling_params=SP)
        wait_written(a, 2 * CHUNKS)  # both ranks' parts of every whole chunk
        assert a.flush_cache()  # the device and host tiers: only the store holds them now
        again = a.generate(input_ids=PROMPT, sampling_params=SP)
    finally:
        a.shutdown()
    parts = info["key_parts"]
    on_disk = parts_on_disk(store, parts)
    b = storage_engine(model_dir, store)
    try:
        loaded = b.generate(input_ids=PROMPT, sampling_params=SP)
        stats = b.stats()
        second = f"{info['namespace']}_{block_hashes(PROMPT, CHUNK, info['hash_algo'])[1]}"
        [path] = store.rglob(f"{second}_{parts[1]}")
        path.unlink()
        assert b.flush_cache()
        partial = b.generate(input_ids=PROMPT, sampling_params=SP)
    finally:
        b.shutdown()
    assert parts == ["h0-1", "h1-2"]
    assert first["meta_info"]["cached_tokens"] == 0
    for out in (again, loaded):
        assert out["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0,
                                                             "storage": LOADED}  # fmt: skip
    assert stats["storage_pages_read"] == 2 * LOADED // CHUNK  # each rank read its parts
    assert stats["storage_cached_tokens"] == LOADED
    # the keys differ per rank, the same pages under each; each rank's bytes are its heads'
    assert len(on_disk[parts[0]]) == len(on_disk[parts[1]]) == CHUNKS
    assert on_disk[parts[0]].keys() == on_disk[parts[1]].keys()
    assert all(on_disk[parts[0]][k] != on_disk[parts[1]][k] for k in on_disk[parts[0]])
    assert partial["meta_info"]["cached_tokens_details"]["storage"] == CHUNK
    for out in (first, again, loaded, partial):
        assert out["output_ids"] == tp1["output_ids"]
        assert logprobs(out) == pytest.approx(logprobs(tp1), abs=1e-4)


def test_a_killed_rank_takes_the_engine_down_with_the_store_in_use(model_dir, tmp_path) -> None:
    """Rank 1 killed after its pages were written and the device and host tiers flushed: the
    next request, which would load them from the store, ends in a 5xx naming the rank, within
    seconds (never waits on the rank's part of the prefetch)."""
    extra = json.dumps({"path": str(tmp_path / "kv"), "chunk_size": CHUNK})
    server = ServerProcess(["--model", str(model_dir), "--tp-size", "2", "--max-total-tokens",
                            "512", "--context-length", "256", "--enable-hierarchical-cache",
                            "--hicache-storage-backend", "file",
                            "--hicache-storage-backend-extra-config", extra,
                            "--hicache-storage-prefetch-policy", "wait_complete"])  # fmt: skip
    try:
        (rank1,) = server.get("/get_server_info").json()["engine"]["tp_rank_pids"]
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
        assert server.post("/generate", body).status == 200
        time.sleep(1.0)  # the writer's turn
        assert server.post("/flush_cache", {}).status == 200
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        reply = server.post("/generate", body)
        assert reply.status >= 500
        assert time.monotonic() - killed < 10
        assert_the_dead_rank_is_named(server, body, rank1)
    finally:
        server.stop(check=False)


def present(cluster, keys: list[str]) -> int:
    """How many of the leading ``keys`` the Mooncake master lists (its own HTTP answer)."""
    import urllib.request

    from radixserve.router.kvindex.mooncake_meta import (
        parse_batch_query,
        present_prefix,
        query_path,
    )

    with urllib.request.urlopen(f"http://{cluster.metrics_addr}{query_path(keys)}") as r:
        return present_prefix(parse_batch_query(r.read(), keys))


def test_mooncake_store_holds_each_ranks_part_and_gives_them_back(model_dir, tp1) -> None:
    """The same through a real Mooncake master and store process: each rank's part of every
    chunk is an object of its own, and a flushed engine loads them back."""
    from mooncake_harness import MooncakeCluster, backend_ports

    cluster = MooncakeCluster(segment_bytes=64 << 20)
    try:
        extra = {"master_server_address": cluster.master_rpc, "chunk_size": CHUNK,
                 **backend_ports(cluster.client_env())}  # fmt: skip
        e = Engine(model=str(model_dir), max_total_tokens=512, context_length=256, tp_size=2,
                   enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                   hicache_storage_backend_extra_config=json.dumps(extra),
                   hicache_storage_prefetch_policy="wait_complete")  # fmt: skip
        try:
            info = e.procs.info["kv_store"]
            first = e.generate(input_ids=PROMPT, sampling_params=SP)
            wait_written(e, 2 * CHUNKS)
            assert e.flush_cache()
            loaded = e.generate(input_ids=PROMPT, sampling_params=SP)
        finally:
            e.shutdown()
        base = [f"{info['namespace']}_{h}" for h in block_hashes(PROMPT, CHUNK, "sha256_cbor")]
        held = [present(cluster, [f"{k}_{p}" for k in base]) for p in info["key_parts"]]
        assert present(cluster, base) == 0  # no whole-page key: only the ranks' parts
    finally:
        cluster.stop()
    assert held == [CHUNKS, CHUNKS]
    assert loaded["meta_info"]["cached_tokens_details"]["storage"] == LOADED
    assert first["output_ids"] == loaded["output_ids"] == tp1["output_ids"]
    assert logprobs(loaded) == pytest.approx(logprobs(tp1), abs=1e-4)
