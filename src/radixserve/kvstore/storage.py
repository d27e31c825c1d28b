"""The storage tier's interface: a backend stores KV pages under chained page-hash keys, write
once, each value framed by a header that proves it is a page of this namespace and size."""

# The rule every backend keeps, and every caller relies on: a page is handed to the caller only
# from a value whose header names the caller's namespace, its key and its page size, and whose
# payload checksum matches; anything else (another model's or layout's bytes, a truncated or
# foreign value, a key written by a different format) is refused and counted, never loaded.
#
# Calls are batched and prefix-shaped, because that is how a radix tree uses them: `exists_prefix`
# says how many of the leading keys are present, `get_pages` loads the leading pages and stops at
# the first one missing, unreadable or refused (the rest is recomputed), `put_pages` writes pages
# that are not there yet and never overwrites (a value is immutable once written: any engine may
# be reading it). A backend whose service fails marks itself down for a while (DownGate) and
# answers as if empty meanwhile: the caller never sees an exception from the storage tier.
#
# Header (little-endian, 56 bytes):  magic "RSKV" | version u16 | header size u16 |
#   payload bytes u64 | sha256(namespace)[:16] | sha256(key)[:16] | xxh3_64(payload) u64

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

MAGIC, VERSION = b"RSKV", 1
HEADER = struct.Struct("<4sHHQ16s16sQ")
Buffer = Any  # a writable (get) or readable (put) bytes-like object of exactly page_nbytes


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:16]


@dataclass(frozen=True, slots=True)
class PageFormat:
    """What must match for stored bytes to be loadable here: the namespace (everything that
    makes KV bytes interchangeable: the engine passes ``cache.hashing.KVNamespace.digest()``)
    and the page's byte size."""

    namespace: str
    page_nbytes: int
    ns_digest: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.page_nbytes < 1:
            raise ValueError(f"page_nbytes must be >= 1, got {self.page_nbytes}")
        if not self.namespace:
            raise ValueError("namespace must not be empty")
        object.__setattr__(self, "ns_digest", _digest(self.namespace))

    @property
    def value_nbytes(self) -> int:
        return HEADER.size + self.page_nbytes

    def frame_into(self, out: memoryview, key: str, payload: Buffer) -> None:
        """Write header + payload into ``out`` (value_nbytes long)."""
        data = memoryview(payload).cast("B")
        if data.nbytes != self.page_nbytes:
            raise ValueError(f"page of {data.nbytes} bytes, this format stores {self.page_nbytes}")
        HEADER.pack_into(out, 0, MAGIC, VERSION, HEADER.size, self.page_nbytes,
                         self.ns_digest, _digest(key), xxhash.xxh3_64_intdigest(data))  # fmt: skip
        out[HEADER.size : self.value_nbytes] = data

    def frame(self, key: str, payload: Buffer) -> bytes:
        out = bytearray(self.value_nbytes)
        self.frame_into(memoryview(out), key, payload)
        return bytes(out)

    def refusal(self, key: str, value: Buffer) -> str | None:
        """None when ``value`` is this key's page in this format, else why it is refused."""
        view = memoryview(value).cast("B")
        if view.nbytes < HEADER.size:
            return "size"
        magic, version, hsize, nbytes, ns, kd, checksum = HEADER.unpack_from(view, 0)
        if magic != MAGIC or version != VERSION or hsize != HEADER.size:
            return "format"
        if ns != self.ns_digest:
            return "namespace"
        if nbytes != self.page_nbytes or view.nbytes != self.value_nbytes:
            return "size"
        if kd != _digest(key):
            return "key"
        if xxhash.xxh3_64_intdigest(view[HEADER.size :]) != checksum:
            return "checksum"
        return None


@dataclass(slots=True)
class StorageStats:
    """Running counts a /metrics page shows."""

    exists_queries: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    misses: int = 0  # a get stopped at a key that is absent or unreadable
    put_failures: int = 0  # a page not written (no space, transfer failed): it stays uncached
    refused: Counter = field(default_factory=Counter)  # reason -> values refused


class StorageBackend(ABC):
    """Pages under string keys, write once. Callers use exactly the first ``n`` pages a call
    reports, and never get an exception for a failing service (it reads as empty)."""

    name: str = ""

    def __init__(self, fmt: PageFormat) -> None:
        self.fmt = fmt
        self.stats = StorageStats()

    @abstractmethod
    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many of the leading ``keys`` are stored."""

    @abstractmethod
    def get_pages(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> int:
        """Load the leading pages into ``buffers`` (one writable page_nbytes buffer per key);
        stop at the first page absent, unreadable or refused. Returns how many were loaded."""

    @abstractmethod
    def put_pages(self, keys: Sequence[str], pages: Sequence[Buffer]) -> int:
        """Store the pages whose keys are not stored yet (never overwrite). Returns how many
        of them are stored after the call (written now or already there)."""

    @property
    def available(self) -> bool:
        """False while the service is marked down (calls answer as if empty)."""
        return True

    def close(self) -> None:  # noqa: B027 - backends without resources keep the default
        """Release the backend's resources."""

    def _check_shapes(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> None:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        for buf in buffers:
            if memoryview(buf).nbytes != self.fmt.page_nbytes:
                raise ValueError(f"buffer of {memoryview(buf).nbytes} bytes, pages are "
                                 f"{self.fmt.page_nbytes}")  # fmt: skip

    def _accept(self, key: str, value: memoryview, out: Buffer) -> bool:
        """Validate one value and copy its payload out; count a refusal."""
        reason = self.fmt.refusal(key, value)
        if reason is not None:
            self.stats.refused[reason] += 1
            return False
        memoryview(out).cast("B")[:] = value[HEADER.size :]
        self.stats.pages_read += 1
        self.stats.bytes_read += self.fmt.page_nbytes
        return True


def take_options(extra: dict, allowed: dict[str, Any], backend: str) -> dict[str, Any]:
    """``allowed`` (name -> default) overridden by ``extra``; an unknown key is refused."""
    unknown = sorted(set(extra) - set(allowed))
    if unknown:
        raise ValueError(f"{backend} backend: unknown extra-config key(s) {unknown}; "
                         f"known: {sorted(allowed)}")  # fmt: skip
    return {**allowed, **extra}


def head_part(rank: int, kv_heads: int) -> str:
    """What a tensor-parallel rank's part of a page holds, as its key names it: KV heads
    ``[rank * kv_heads, (rank + 1) * kv_heads)`` of the model (``h2-4``). The key says which
    heads the bytes are, not who wrote them, so a part is the same object at any rank count
    that splits the heads the same way (the namespace's head count tells the splits apart)."""
    return f"h{rank * kv_heads}-{(rank + 1) * kv_heads}"


class PartKeys(StorageBackend):
    """``inner`` with every key suffixed ``_<part>``: one rank's share of each page of a model
    split over ranks (``head_part``). Its stats and down-gate are the inner backend's."""

    def __init__(self, inner: StorageBackend, part: str) -> None:
        super().__init__(inner.fmt)
        self.inner, self.part, self.name = inner, part, inner.name
        self.stats = inner.stats
        self.gate = getattr(inner, "gate", None)

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [f"{k}_{self.part}" for k in keys]

    def exists_prefix(self, keys: Sequence[str]) -> int:
        return self.inner.exists_prefix(self._keys(keys))

    def get_pages(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> int:
        return self.inner.get_pages(self._keys(keys), buffers)

    def put_pages(self, keys: Sequence[str], pages: Sequence[Buffer]) -> int:
        return self.inner.put_pages(self._keys(keys), pages)

    @property
    def available(self) -> bool:
        return self.inner.available

    def close(self) -> None:
        self.inner.close()
