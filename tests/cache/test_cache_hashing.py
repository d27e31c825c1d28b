"""Chained block hashes: prefix property, determinism across processes, documented format."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import cbor2
import pytest
import xxhash

from radixserve.cache.hashing import ALGORITHMS, KVNamespace, block_hashes, page_keys

TOKENS = list(range(1000, 1040))


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_equal_prefix_equal_hashes(algo: str) -> None:
    a = block_hashes(TOKENS, 8, algo)
    b = block_hashes(TOKENS[:20] + [7] * 20, 8, algo)
    assert len(a) == 5 and a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a[3:], b[3:])), "a change must carry down the chain"


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_seed_namespace_and_partial_block(algo: str) -> None:
    base = block_hashes(TOKENS, 16, algo)
    assert len(base) == 2
    assert len(block_hashes(TOKENS, 16, algo, hash_partial=True)) == 3
    assert block_hashes(TOKENS, 16, algo, seed=1) != base
    assert block_hashes(TOKENS, 16, algo, namespace="lora-a") != base


def test_documented_definitions() -> None:
    toks = [1, 2, 3, 4]
    tb = b"".join(t.to_bytes(8, "little", signed=True) for t in toks)
    root = hashlib.sha256(b"radixserve::0").digest()
    assert block_hashes(toks, 4, "sha256") == [hashlib.sha256(root + tb).hexdigest()]
    croot = hashlib.sha256(cbor2.dumps(["radixserve", "", 0], canonical=True)).digest()
    want = hashlib.sha256(cbor2.dumps([croot, toks], canonical=True)).hexdigest()
    assert block_hashes(toks, 4, "sha256_cbor") == [want]
    xroot = xxhash.xxh64_intdigest(b"radixserve:", seed=5)
    want_x = xxhash.xxh64_intdigest(xroot.to_bytes(8, "little") + tb, seed=5)
    assert block_hashes(toks, 4, "xxhash64", seed=5) == [want_x]


def test_same_in_another_process() -> None:
    code = "from radixserve.cache.hashing import block_hashes; print(block_hashes(list(range(64)), 16, 'xxhash64'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(block_hashes(list(range(64)), 16, "xxhash64"))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        block_hashes(TOKENS, 16, "md5")
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, 0)


# -- lower-tier keys -------------------------------------------------------------------------------
def _ns(**kw: object) -> KVNamespace:
    base = dict(model="SmolLM2-135M", dtype="bfloat16", num_layers=30, num_kv_heads=3,
                head_dim=64, page_size=16)  # fmt: skip
    return KVNamespace(**{**base, **kw})  # type: ignore[arg-type]


def test_llumnix_algorithm_names_are_the_same_hashes() -> None:
    assert block_hashes(TOKENS, 8, "sha256_hex") == block_hashes(TOKENS, 8, "sha256")
    assert block_hashes(TOKENS, 8, "xxhash", seed=3) == block_hashes(TOKENS, 8, "xxhash64", seed=3)


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256_hex", "xxhash"])
def test_page_keys_chain_per_chunk_under_the_namespace(algo: str) -> None:
    keys = page_keys(TOKENS, _ns(), 16, algo, seed=1)
    assert len(keys) == 2 and len(set(keys)) == 2
    prefix = _ns().digest()
    assert all(k.startswith(prefix + "_") for k in keys) and prefix.startswith("rkv1-")
    assert page_keys(TOKENS[:32] + [5] * 8, _ns(), 16, algo, seed=1) == keys  # a prefix property
    assert page_keys(TOKENS, _ns(), 16, algo, seed=2) != keys  # the seed counts
    assert len(page_keys(TOKENS, _ns(), 32, algo)) == 1


@pytest.mark.parametrize(
    "change",
    [
        dict(model="other"),
        dict(dtype="float16"),
        dict(num_layers=29),
        dict(num_kv_heads=6),
        dict(head_dim=128),
        dict(page_size=32),
        dict(layout="token,layer,kv,head,dim"),
        dict(byteorder="big"),
    ],  # fmt: skip
)
def test_anything_that_changes_the_bytes_changes_every_key(change: dict) -> None:
    theirs = _ns(**change)
    assert theirs.digest() != _ns().digest()
    mine = set(page_keys(TOKENS, _ns(), 32))
    assert mine.isdisjoint(page_keys(TOKENS, theirs, 32))


def test_page_keys_refuse_chunks_that_are_not_whole_pages() -> None:
    with pytest.raises(ValueError, match="multiple of the page size"):
        page_keys(TOKENS, _ns(), 24)
    with pytest.raises(ValueError, match="model identity"):
        _ns(model="")
    with pytest.raises(ValueError, match="num_layers"):
        _ns(num_layers=0)
