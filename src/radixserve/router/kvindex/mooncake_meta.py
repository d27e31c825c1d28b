"""PURE: the store keys a router computes for a prompt (the engines' `page_keys`, from token ids
and the namespace digest the engines report), and Mooncake master's answer to `GET /batch_query_keys?keys=a,b,...` (its metrics/admin
port) turned into where each chained page key lives, and each holder's longest prefix hit."""

# The answer (master 0.3.13, captured in tests/fixtures/mooncake_batch_query_keys.json):
#   {"success": true, "data": {KEY: {"ok": bool, "error": str|null,
#       "values": [{"size_": n, "buffer_address_": a, "protocol_": "tcp",
#                   "transport_endpoint_": "HOST:PORT"}] | null,      memory replicas
#       "disk_values": [{"file_path", "object_size"}] | null,         shared file replicas
#       "local_disk_values": [{"client_id", "object_size", "transport_endpoint"}] | null,
#       "nof_values": [<like values>] | null}}}
# A key not held is {"ok": false, "error": "OBJECT_NOT_FOUND"}. `data` is a map, not a list:
# the answer is matched to the query by key, and a key the master left out is an error (the
# answer is refused rather than read as a miss). A replica's transport endpoint names the
# segment's holder (an engine, or the store process that serves every engine); a disk replica
# on a shared file system has no holder and is readable by all (endpoint SHARED).
# The master splits `keys` on ',' after URL-decoding, so a key containing ',' cannot be asked
# for: it is refused when the query is built. A long prompt's keys go in several requests of
# bounded length (query_chunks); once a chunk's keys stop being held anywhere, no holder's prefix
# can grow, so the keys after it are not asked for and read as NOT_QUERIED misses.

from __future__ import annotations

import json
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import quote

from radixserve.cache.hashing import block_hashes

SHARED = ""  # endpoint of a replica any client can read (a shared-file disk replica)
_MEDIA = (("values", "memory", "transport_endpoint_"), ("nof_values", "nof", "transport_endpoint_"),
          ("local_disk_values", "local_disk", "transport_endpoint"), ("disk_values", "disk", None))  # fmt: skip


class MetadataAnswerError(ValueError):
    """The master's answer is not the documented shape (or not for these keys)."""


@dataclass(frozen=True, slots=True)
class Replica:
    endpoint: str  # transport endpoint of the holder; SHARED for a shared-file replica
    medium: str  # memory | nof | local_disk | disk
    size: int


@dataclass(frozen=True, slots=True)
class KeyLocation:
    ok: bool
    replicas: tuple[Replica, ...] = ()
    error: str | None = None


MAX_PATH_BYTES = 16_384  # one request's path; HTTP clients refuse URLs over 64 KiB (httpx)
NOT_QUERIED = "NOT_QUERIED"  # error of keys after a chunk whose prefix ended: none can extend it


def store_keys(
    token_ids: Sequence[int],
    digest: str,
    chunk_size: int,
    algorithm: str = "sha256_cbor",
    seed: int = 0,
    cache_namespace: str | None = None,
    partial: bool = False,
) -> list[str]:
    """The keys engines store a prompt's chunks under (cache.hashing.page_keys) from the
    namespace digest they report alone (a router has no KVNamespace of its own); with
    ``partial`` (Llumnix's --kvs-enable-save-unfull-chunk) the trailing partial chunk's too."""
    hashes = block_hashes(token_ids, chunk_size, algorithm, seed, cache_namespace, partial)
    return [f"{digest}_{h:016x}" if isinstance(h, int) else f"{digest}_{h}" for h in hashes]


def query_path(keys: Sequence[str]) -> str:
    """The request path for ``keys`` (at least one; none may contain ',' or be empty)."""
    if not keys:
        raise ValueError("batch_query_keys needs at least one key")
    for key in keys:
        if not key or "," in key:
            raise ValueError(f"key {key!r} cannot be queried (empty, or contains ',')")
    return "/batch_query_keys?keys=" + quote(",".join(keys), safe=",")


def query_chunks(keys: Sequence[str], max_path: int = MAX_PATH_BYTES) -> list[list[str]]:
    """``keys`` cut into consecutive runs whose query path fits ``max_path`` bytes (a prompt of
    8,000 tokens in 16-token pages is 500 keys, ~45 KB of path). A key too long for one path is
    a ValueError."""
    chunks: list[list[str]] = []
    budget = max_path - len(query_path(["x"])) + 1
    room = 0
    for key in keys:
        size = len(quote(key, safe="")) + 1
        if size > budget:
            raise ValueError(f"key of {len(key)} characters does not fit one query")
        if not chunks or size > room:
            chunks.append([])
            room = budget
        chunks[-1].append(key)
        room -= size
    return chunks


def parse_batch_query(body: bytes | str, keys: Sequence[str]) -> list[KeyLocation]:
    """Where each of ``keys`` lives, in the order of ``keys``."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise MetadataAnswerError(f"answer is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("success") is not True:
        raise MetadataAnswerError(f"master refused the query: {str(doc)[:200]}")
    data = doc.get("data")
    if not isinstance(data, dict):
        raise MetadataAnswerError("answer has no 'data' map")
    missing = [k for k in keys if k not in data]
    if missing:
        raise MetadataAnswerError(
            f"answer lacks {len(missing)} queried key(s), e.g. {missing[0]!r}"
        )
    return [_location(data[k]) for k in keys]


def _location(item: object) -> KeyLocation:
    if not isinstance(item, dict) or not isinstance(item.get("ok"), bool):
        raise MetadataAnswerError(f"key entry has no boolean 'ok': {str(item)[:200]}")
    if not item["ok"]:
        return KeyLocation(False, (), str(item.get("error") or "unknown"))
    replicas: list[Replica] = []
    for field, medium, endpoint_field in _MEDIA:
        for rep in item.get(field) or ():
            if not isinstance(rep, dict):
                raise MetadataAnswerError(f"{field} entry is not an object: {rep!r}")
            endpoint = SHARED if endpoint_field is None else rep.get(endpoint_field)
            if not isinstance(endpoint, str):
                raise MetadataAnswerError(f"{field} entry has no {endpoint_field}: {rep!r}")
            replicas.append(
                Replica(endpoint, medium, int(rep.get("size_", rep.get("object_size", 0))))
            )
    return KeyLocation(True, tuple(replicas))


def present_prefix(locations: Sequence[KeyLocation]) -> int:
    """How many leading keys are held somewhere."""
    n = 0
    while n < len(locations) and locations[n].ok and locations[n].replicas:
        n += 1
    return n


def prefix_by_holder(locations: Sequence[KeyLocation]) -> dict[str, int]:
    """Each holder's longest contiguous prefix hit: how many leading keys it holds, a SHARED
    replica counting for every holder. Holders that hold no leading key are absent."""
    held = [_holders(loc) for loc in locations]
    runs: dict[str, int] = {}
    for holder in set().union(*held) if held else ():
        n = 0
        while n < len(held) and (holder in held[n] or SHARED in held[n]):
            n += 1
        if n:
            runs[holder] = n
    return runs


def loadable_prefix(
    locations: Sequence[KeyLocation],
    worker_endpoints: Mapping[Hashable, str | None],
    shared: Collection[str] = (),
) -> dict[Hashable, int]:
    """Each worker's contiguous prefix it can load: keys held by its own segment (the endpoint
    it reports; None when it holds none) or by a shared holder (the store process's endpoint in
    ``shared``, or a SHARED disk replica), which every worker reads."""
    common = set(shared) | {SHARED}
    held = [_holders(loc) for loc in locations]
    out: dict[Hashable, int] = {}
    for worker, endpoint in worker_endpoints.items():
        mine = common | ({endpoint} if endpoint else set())
        n = 0
        while n < len(held) and held[n] & mine:
            n += 1
        out[worker] = n
    return out


def _holders(loc: KeyLocation) -> set[str]:
    return {r.endpoint for r in loc.replicas} if loc.ok else set()
