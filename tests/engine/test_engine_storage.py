"""The storage tier in the engine (`--hicache-storage-backend file`), two real engine processes
on the tiny models: engine A writes a prompt's pages, engine B serves a request sharing it by
loading them from the store (cached tokens reported by tier), with the output and logprobs of its
own recomputation; a value of another namespace or a damaged one is refused and recomputed."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from radixserve import Engine  # noqa: E402
from radixserve.cache.hashing import block_hashes  # noqa: E402
from radixserve.kvstore.storage import HEADER, PageFormat  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

CHUNK = 16
rng = random.Random(5)
SHARED = [rng.randrange(4, 300) for _ in range(100)]
PROMPT_A = SHARED + [rng.randrange(4, 300) for _ in range(7)]
PROMPT_B = SHARED + [rng.randrange(4, 300) for _ in range(9)]
LOADED = (len(PROMPT_B) - 1) // CHUNK * CHUNK  # whole chunks before the last token
SP = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "return_logprob": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama3", tmp_path_factory.mktemp("tiny-storage"))


def engine(model_dir: Path, store: Path, policy: str = "wait_complete", **kw) -> Engine:
    extra = {"path": str(store), "chunk_size": CHUNK}
    return Engine(model=str(model_dir), max_total_tokens=512, context_length=256,
                  enable_hierarchical_cache=True, hicache_storage_backend="file",
                  hicache_storage_backend_extra_config=json.dumps(extra),
                  hicache_storage_prefetch_policy=policy, **kw)  # fmt: skip


def wait_written(e: Engine, pages: int, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = e.stats()
        if stats["storage_pages_written"] >= pages:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"{pages} pages not written: {stats}")


def logprobs(out: dict) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def written(model_dir, tmp_path_factory) -> tuple[Path, dict, dict]:
    """Engine A's store: the pages of PROMPT_B, written once; A's output and its store info."""
    store = tmp_path_factory.mktemp("kv-a") / "kv"
    a = engine(model_dir, store)
    try:
        out_a = a.generate(input_ids=PROMPT_B, sampling_params=SP)
        stats = wait_written(a, len(SHARED) // CHUNK)
        assert stats["storage_bytes_written"] > 0
        info = a.procs.info["kv_store"]
    finally:
        a.shutdown()
    return store, out_a, info


def serve_b(model_dir: Path, store: Path, policy: str) -> tuple[dict, dict, dict, dict]:
    """Engine B on ``store``: the request loaded, again (device), B's own recomputation (the
    store emptied, the cache flushed), and B's stats."""
    b = engine(model_dir, store, policy)
    try:
        got = b.generate(input_ids=PROMPT_B, sampling_params=SP)
        again = b.generate(input_ids=PROMPT_B, sampling_params=SP)  # now in B's device pool
        stats = b.stats()
        shutil.rmtree(store)  # B's own recomputation: nothing cached in any tier
        assert b.flush_cache()
        recompute = b.generate(input_ids=PROMPT_B, sampling_params=SP)
    finally:
        b.shutdown()
    assert again["meta_info"]["cached_tokens_details"]["device"] > 0
    assert recompute["meta_info"]["cached_tokens"] == 0
    assert got["output_ids"] == recompute["output_ids"]
    assert logprobs(got) == pytest.approx(logprobs(recompute), abs=1e-4)
    return got, again, recompute, stats


def test_best_effort_never_holds_a_request(model_dir, written, tmp_path) -> None:
    """best_effort: queued at once; what landed by its admission is used (all or none here)."""
    store = tmp_path / "kv"
    shutil.copytree(written[0], store)
    got, _, _, stats = serve_b(model_dir, store, "best_effort")
    assert stats["storage_prefetch_waits"] == 0 and stats["storage_prefetch_lookups"] == 1
    assert got["meta_info"]["cached_tokens_details"]["storage"] in (0, LOADED)
    assert got["output_ids"] == written[1]["output_ids"]


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_engine_b_loads_what_engine_a_wrote(model_dir, written, tmp_path, policy: str) -> None:
    store = tmp_path / "kv"
    shutil.copytree(written[0], store)
    got, _, _, stats = serve_b(model_dir, store, policy)
    meta = got["meta_info"]
    loaded = LOADED
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": loaded}
    assert meta["cached_tokens"] == loaded
    assert got["output_ids"] == written[1]["output_ids"]
    assert stats["storage_pages_read"] == loaded // CHUNK and stats["storage_bytes_read"] > 0
    assert stats["storage_prefetch_waits"] == 1 and stats["storage_cached_tokens"] == loaded


@pytest.mark.parametrize("forged", ["namespace", "size", "empty"])
def test_a_foreign_or_wrong_size_page_is_refused_and_recomputed(
    model_dir, written, tmp_path, forged: str
) -> None:
    """The store's second page replaced by a value of another namespace, or of another size, or
    by nothing (what Mooncake returns for a key it lists but can no longer read) under the same
    key: B loads the first page only and computes the rest."""
    store = tmp_path / "kv"
    shutil.copytree(written[0], store)
    info = written[2]
    key = f"{info['namespace']}_{block_hashes(PROMPT_B, CHUNK, info['hash_algo'])[1]}"
    [path] = [p for p in store.rglob(key)]
    nbytes = path.stat().st_size - HEADER.size
    fmt = PageFormat("another-model" if forged == "namespace" else info["namespace"],
                     nbytes if forged == "namespace" else nbytes // 2)  # fmt: skip
    path.write_bytes(b"" if forged == "empty" else fmt.frame(key, bytes(fmt.page_nbytes)))
    got, _, _, stats = serve_b(model_dir, store, "wait_complete")
    assert got["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": CHUNK}
    assert stats["storage_refused_pages"] == 1 and stats["storage_prefetch_failures"] == 1
    assert got["output_ids"] == written[1]["output_ids"]


def wait_unpinned(e: Engine, timeout_s: float = 30.0) -> dict:
    """Stats once the writer has read every page it was handed (the scheduler unpinned them)."""
    deadline = time.monotonic() + timeout_s
    while (stats := e.stats())["storage_write_pinned_tokens"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


def test_pages_the_store_already_holds_are_never_read(model_dir, written, tmp_path) -> None:
    """Engine B computes PROMPT_B while its store cannot be written (the write fails: its keys
    are not remembered as stored); engine A's pages of it then appear in the store; B serves
    PROMPT_B again from its device pool and offers it again: B's writer asks the store first
    and reads none of those pages from B's pool (the scheduler thread never reads any)."""
    store = tmp_path / "kv"
    b = engine(model_dir, store)
    try:
        [ns_dir] = store.iterdir()
        shutil.rmtree(ns_dir)
        ns_dir.write_bytes(b"")  # a file where the pages' directory goes: every write fails
        first = b.generate(input_ids=PROMPT_B, sampling_params=SP)
        stats = wait_unpinned(b)
        assert stats["storage_pages_gathered"] == len(SHARED) // CHUNK  # read, not stored
        assert stats["storage_pages_written"] == 0
        ns_dir.unlink()
        shutil.copytree(written[0] / ns_dir.name, ns_dir)  # A's pages, B's namespace
        again = b.generate(input_ids=PROMPT_B, sampling_params=SP)
        stats = wait_unpinned(b)
    finally:
        b.shutdown()
    assert again["meta_info"]["cached_tokens_details"]["device"] > 0
    assert stats["storage_pages_gathered"] == len(SHARED) // CHUNK  # none read again
    assert stats["storage_pages_written"] == 0
    assert again["output_ids"] == first["output_ids"] == written[1]["output_ids"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_stored_page_layout_and_round_trip(dtype: str) -> None:
    """A stored page is [layers, 2, chunk, heads, dim] of the device pool's bytes (the
    namespace's layout); written into host slots it gives back the same K/V."""
    import torch

    from radixserve.model.host_pool import HostKVPool
    from radixserve.model.kv_pool import KVPool

    pool = KVPool(3, 256, 2, 8, getattr(torch, dtype), "cpu")
    pool.kv.normal_()
    host = HostKVPool(pool, 512)
    slots = list(range(200, 232))[::-1]  # any order: a page follows its slots
    pages = host.read_device_pages(slots, CHUNK)
    assert len(pages) == 2
    want = pool.kv[:, :, slots[CHUNK:]].contiguous().view(torch.uint8).numpy().tobytes()
    assert bytes(pages[1]) == want
    host.write_host_pages(list(range(300, 332)), bytearray(b"".join(pages)), CHUNK)
    assert torch.equal(host.kv[:, :, 300:332], pool.kv[:, :, slots])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--hicache-storage-backend", "file"], "only with --enable-hierarchical-cache"),
        (["--enable-hierarchical-cache", "--hicache-storage-prefetch-policy", "timeout"],
         "only with --hicache-storage-backend"),
        (["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
          "--hicache-storage-backend-extra-config", "{bad"], "is not JSON"),
        (["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
          "--hicache-storage-backend-extra-config", '{"chunk_size": 0}'], "chunk_size must be"),
        (["--sim", "tiny-cpu", "--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
         "needs a real model"),
    ],
)  # fmt: skip
def test_bad_storage_flags_are_one_line_errors(args: list[str], says: str) -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "radixserve", "serve", *args],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2
    [line] = run.stderr.strip().splitlines()
    assert says in line


def test_prefetch_timeout_is_sglangs() -> None:
    from radixserve.engine.storage_settings import prefetch_timeout_s

    assert prefetch_timeout_s(0) == 2.0
    assert prefetch_timeout_s(2048) == pytest.approx(2.2)
    assert prefetch_timeout_s(10**7) == 30.0


def test_models_that_share_a_name_do_not_share_a_namespace(model_dir, tmp_path) -> None:
    from radixserve.engine.storage_settings import weights_identity

    other = build_tiny_model("llama3", tmp_path / "other", seed=1)  # same name, other weights
    assert weights_identity(model_dir) == weights_identity(model_dir)
    assert weights_identity(other) != weights_identity(model_dir)
