"""Chained block hashes of token ids: the one definition of a prefix key that the engine (KV
events) and the router (prefix lookup in an index or a metadata store) both use.

Token ids are cut into blocks of ``block_size``; block ``i``'s hash takes block ``i - 1``'s hash
as input, so equal hashes at block ``i`` mean equal prefixes up to the end of block ``i``. A
trailing partial block is hashed only when ``hash_partial`` is set.

Exact definitions, so another system can compute the same keys (``toks`` is the block's token
ids; ``ns`` the namespace string, "" when absent; integers are little-endian):

``sha256`` (hex strings)
    root   = sha256(b"radixserve:" + ns.encode() + b":" + str(seed).encode()).digest()
    h[i]   = sha256(h[i-1] + b"".join(t.to_bytes(8, "little", signed=True) for t in toks))
    output = h[i].hex()   (64 lowercase hex characters; h[-1] is root)

``sha256_cbor`` (hex strings)
    root   = sha256(cbor2.dumps(["radixserve", ns, seed], canonical=True)).digest()
    h[i]   = sha256(cbor2.dumps([h[i-1], list(toks)], canonical=True)).digest()
    output = h[i].hex()

``xxhash64`` (unsigned 64-bit ints)
    root   = xxh64(b"radixserve:" + ns.encode(), seed=seed)
    h[i]   = xxh64(h[i-1].to_bytes(8, "little") + <toks as int64 little-endian>, seed=seed)

Llumnix's ``--kvs-hash-algo`` names are accepted too: ``sha256_hex`` is ``sha256``, ``xxhash``
is ``xxhash64``.

Lower-tier keys (``page_keys``): one key per chunk of ``chunk_size`` tokens (whole pages; Llumnix's
``--kvs-chunk-size``), ``<namespace digest>_<chain hash as hex>``. The digest (``KVNamespace``)
names everything that must match for stored bytes to be interchangeable (model, logical dtype,
layers, KV heads, head dim, page size, byte layout and order), so engines of another model or
layout never read them: a mismatch misses, it never collides (SGLang's unified key scheme does
the same).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

import cbor2
import xxhash

HashValue = Any  # str for the sha256 family, int for xxhash64


def _tokens_bytes(toks: Sequence[int]) -> bytes:
    if _LITTLE:  # one C pass instead of one Python call per token; the same bytes
        try:
            return array("q", toks).tobytes()
        except (OverflowError, TypeError):
            pass
    return b"".join(t.to_bytes(8, "little", signed=True) for t in toks)


_LITTLE = sys.byteorder == "little"


def _sha256_root(ns: str, seed: int) -> bytes:
    return hashlib.sha256(b"radixserve:" + ns.encode() + b":" + str(seed).encode()).digest()


def _sha256_step(prev: bytes, toks: Sequence[int], seed: int) -> bytes:
    return hashlib.sha256(prev + _tokens_bytes(toks)).digest()


def _cbor_root(ns: str, seed: int) -> bytes:
    return hashlib.sha256(cbor2.dumps(["radixserve", ns, seed], canonical=True)).digest()


def _cbor_step(prev: bytes, toks: Sequence[int], seed: int) -> bytes:
    return hashlib.sha256(cbor2.dumps([prev, list(toks)], canonical=True)).digest()


def _xx_root(ns: str, seed: int) -> int:
    return xxhash.xxh64_intdigest(b"radixserve:" + ns.encode(), seed=seed)


def _xx_step(prev: int, toks: Sequence[int], seed: int) -> int:
    return xxhash.xxh64_intdigest(prev.to_bytes(8, "little") + _tokens_bytes(toks), seed=seed)


@dataclass(frozen=True, slots=True)
class _Algo:
    root: Callable[[str, int], Any]
    step: Callable[[Any, Sequence[int], int], Any]
    out: Callable[[Any], HashValue]

    def chain(
        self, prev: Any, token_ids: Sequence[int], block_size: int, seed: int, partial: bool = False
    ) -> list[Any]:
        """Chain states of the whole blocks of ``token_ids`` (and of the partial last one when
        ``partial``) that follow the state ``prev``: the one loop the engine's KV events, the
        router's keys and ``block_hashes`` share."""
        step, whole = self.step, len(token_ids) - len(token_ids) % block_size
        out = []
        for start in range(0, whole, block_size):
            prev = step(prev, token_ids[start : start + block_size], seed)
            out.append(prev)
        if partial and whole < len(token_ids):
            out.append(step(prev, token_ids[whole:], seed))
        return out


ALGORITHMS: dict[str, _Algo] = {
    "sha256": _Algo(_sha256_root, _sha256_step, bytes.hex),
    "sha256_cbor": _Algo(_cbor_root, _cbor_step, bytes.hex),
    "xxhash64": _Algo(_xx_root, _xx_step, lambda h: h),
}
ALGORITHMS["sha256_hex"] = ALGORITHMS["sha256"]  # Llumnix's names for the same two
ALGORITHMS["xxhash"] = ALGORITHMS["xxhash64"]


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = 16,
    algorithm: str = "sha256",
    seed: int = 0,
    namespace: str | None = None,
    hash_partial: bool = False,
) -> list[HashValue]:
    """Chained hash of every whole block of ``token_ids`` (and of the partial last block when
    ``hash_partial``). Deterministic across processes and machines (no use of ``hash()``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    algo = ALGORITHMS.get(algorithm)
    if algo is None:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; choose from {sorted(ALGORITHMS)}")
    states = algo.chain(algo.root(namespace or "", seed), token_ids, block_size, seed, hash_partial)
    return [algo.out(s) for s in states]


# -- keys of the lower KV tiers -------------------------------------------------------------------
KEY_SCHEMA = 1  # part of every digest: a change of the key format changes every key


@dataclass(frozen=True, slots=True)
class KVNamespace:
    """Everything that must match for two engines' stored KV bytes to be interchangeable."""

    model: str  # the model's identity (name or weights digest), never empty
    dtype: str  # the logical KV dtype, e.g. "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    layout: str = "layer,kv,token,head,dim"  # the order of a stored page's axes
    byteorder: str = sys.byteorder

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a KV namespace needs a model identity: '' would merge models")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"KV namespace {f.name} must be >= 1, got {value}")

    def digest(self) -> str:
        """``rkv<schema>-<16 hex>``: sha256 of the canonical CBOR of every field."""
        raw = cbor2.dumps([KEY_SCHEMA, *astuple(self)], canonical=True)
        return f"rkv{KEY_SCHEMA}-{hashlib.sha256(raw).hexdigest()[:16]}"


def page_keys(
    token_ids: Sequence[int],
    namespace: KVNamespace,
    chunk_size: int | None = None,
    algorithm: str = "sha256_cbor",
    seed: int = 0,
    cache_namespace: str | None = None,
) -> list[str]:
    """One storage key per whole chunk of ``token_ids`` (``chunk_size`` tokens, a multiple of
    the page size; default one page), computable from token ids alone: the chained hash of the
    chunk (``block_hashes``, with the request's cache namespace: LoRA id, salt) under the
    namespace digest."""
    chunk = namespace.page_size if chunk_size is None else chunk_size
    if chunk < 1 or chunk % namespace.page_size:
        raise ValueError(
            f"chunk_size must be a positive multiple of the page size {namespace.page_size}, "
            f"got {chunk}"
        )
    prefix = namespace.digest()
    hashes = block_hashes(token_ids, chunk, algorithm, seed, cache_namespace)
    return [f"{prefix}_{h:016x}" if isinstance(h, int) else f"{prefix}_{h}" for h in hashes]
