"""The shared prefix index in Redis (Llumnix's KV metadata service): the schema, the batched
writes of `radixserve kv-indexer`, and the one-round-trip lookup that routers make per request.

Schema (``P`` is the key prefix, ``radixserve`` by default; every value is a string):

``P:workers``    HASH  worker URL -> JSON ``{"n": int, "block_size": int, "hash_algo": str}``:
                 the workers the indexer follows. ``n`` is the worker's small number, used in
                 the block sets because an integer member keeps a set in Redis' compact intset
                 encoding (a URL would cost ~10x the memory per block).
``P:wurl``       HASH  worker number -> worker URL (the lookup script answers with URLs).
``P:wnext``      STRING counter that hands out worker numbers.
``P:b:<key>``    SET   worker numbers that hold the block whose key is ``<key>``: the router's
                 own chained block hash (router/kvindex/block_index.py: xxhash64 of ``cache/hashing.py``,
                 seed 0) of the prompt's tokens up to the end of the block, written as 16
                 lowercase hex digits.
                 The namespace (LoRA adapter, cache salt) is the chain's root, so equal keys
                 mean equal namespace and equal tokens from the first token on.
``P:m:<n>``      HASH  engine block hash -> ``<key>``, everything worker ``n`` holds: resolves
                 ``BlockRemoved`` (which names the engine's hashes) and lets a worker's entries
                 be dropped completely.

A worker ``n`` holds block ``<key>`` exactly when ``n`` is in ``P:b:<key>`` and ``<key>`` is a
value of ``P:m:<n>``; every write keeps both, in one atomic script (`WRITE_LUA`) per event batch
or per run of batches that queued up meanwhile.
Lookup: ``EVALSHA`` of `LOOKUP_LUA` with KEYS = [``P:wurl``] and ARGV = [``P:b:``, the prompt's
block keys in order, concatenated (16 hex digits each)] returns a flat list ``[url, blocks,
url, blocks, ...]``: each worker's longest contiguous cached prefix, in blocks, for every
worker that holds block 1. (One string argument, not one key per block: redis-py spends
about 5 us packing each argument, more than the script spends walking the block.) A router
reads ``P:workers`` (who is indexed, at which block size) once a second besides.
Workers with different block sizes need one key list each; they go in one pipeline, so a
lookup is one round trip whatever the fleet. (Redis Cluster would need a hash tag in ``P``.)
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError

LOOKUP_LUA = """
local prefix, blob, depth = ARGV[1], ARGV[2], {}
local alive = redis.call('SMEMBERS', prefix .. string.sub(blob, 1, 16))
for _, m in ipairs(alive) do depth[m] = 1 end
for i = 2, #blob / 16 do
  if #alive == 0 then break end
  local key, nxt = prefix .. string.sub(blob, 16 * i - 15, 16 * i), {}
  if #alive == 1 then  -- the usual case past the first blocks: no reply table to build
    if redis.call('SISMEMBER', key, alive[1]) == 1 then nxt[1] = alive[1] end
  else
    local held = redis.call('SMISMEMBER', key, unpack(alive))
    for j, m in ipairs(alive) do if held[j] == 1 then nxt[#nxt + 1] = m end end
  end
  for _, m in ipairs(nxt) do depth[m] = i end
  alive = nxt
end
local out = {}
for m, d in pairs(depth) do
  local url = redis.call('HGET', KEYS[1], m)
  if url then out[#out + 1] = url; out[#out + 1] = d end
end
return out
"""

# ARGV = [P:b:, P:m:, then per batch: n, cleared "1"/"0", keys held now (16 hex digits each,
# concatenated), keys no longer held (same), "engine_hash key ..." to map, "engine_hash ..." to
# unmap]. One script per group of batches: atomic, and one command for redis-py to pack.
WRITE_LUA = """
local bp, mp = ARGV[1], ARGV[2]
for i = 3, #ARGV, 6 do
  local n, owned = ARGV[i], mp .. ARGV[i]
  if ARGV[i + 1] == '1' then
    for _, k in ipairs(redis.call('HVALS', owned)) do redis.call('SREM', bp .. k, n) end
    redis.call('DEL', owned)
  end
  local rel, hold = ARGV[i + 3], ARGV[i + 2]
  for j = 1, #rel, 16 do redis.call('SREM', bp .. string.sub(rel, j, j + 15), n) end
  for eh in string.gmatch(ARGV[i + 5], '%S+') do redis.call('HDEL', owned, eh) end
  for j = 1, #hold, 16 do redis.call('SADD', bp .. string.sub(hold, j, j + 15), n) end
  for eh, k in string.gmatch(ARGV[i + 4], '(%S+) (%S+)') do redis.call('HSET', owned, eh, k) end
end
return 1
"""

# KEYS = [P:m:<n>, P:workers, P:wurl]; ARGV = [n, block key prefix "P:b:", url or "" to keep
# the worker registered]. Drops everything the worker holds in one atomic step.
DROP_LUA = """
local keys = redis.call('HVALS', KEYS[1])
for _, k in ipairs(keys) do redis.call('SREM', ARGV[2] .. k, ARGV[1]) end
redis.call('DEL', KEYS[1])
if ARGV[3] ~= '' then
  redis.call('HDEL', KEYS[2], ARGV[3])
  redis.call('HDEL', KEYS[3], ARGV[1])
end
return #keys
"""


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """What ``P:workers`` says of one worker."""

    url: str
    n: int
    block_size: int
    hash_algo: str


@dataclass(slots=True)
class BlockDiff:
    """One event batch's effect on one worker, as Redis writes: its engine-hash map entries
    set and deleted, and the block keys it starts and stops holding."""

    mapped: list[tuple[str, str]] = field(default_factory=list)  # engine hash, block key
    unmapped: list[str] = field(default_factory=list)  # engine hashes
    hold: list[str] = field(default_factory=list)  # block keys
    release: list[str] = field(default_factory=list)
    cleared: bool = False  # everything the worker held before this diff is gone

    def __bool__(self) -> bool:
        return bool(self.mapped or self.unmapped or self.hold or self.release or self.cleared)


class Schema:
    """Key names under one prefix."""

    def __init__(self, prefix: str = "radixserve") -> None:
        self.prefix = prefix
        self.workers, self.wurl, self.wnext = (
            f"{prefix}:workers",
            f"{prefix}:wurl",
            f"{prefix}:wnext",
        )
        self.block_prefix = f"{prefix}:b:"

    def owned(self, n: int) -> str:
        return f"{self.prefix}:m:{n}"


class RedisIndexStore:
    """Reads and writes the schema above through a `redis.asyncio.Redis` client. Every method
    is one round trip (a pipeline or a script), except `register` for a new worker."""

    def __init__(self, client: Any, prefix: str = "radixserve") -> None:
        self.client, self.keys = client, Schema(prefix)
        self._drop = client.register_script(DROP_LUA)
        self._lookup_sha = hashlib.sha1(LOOKUP_LUA.encode()).hexdigest()
        self._write_sha = hashlib.sha1(WRITE_LUA.encode()).hexdigest()

    async def workers(self) -> dict[str, WorkerEntry]:
        raw = await self.client.hgetall(self.keys.workers)
        return {_s(url): _entry(_s(url), meta) for url, meta in raw.items()}

    async def register(self, url: str, block_size: int, hash_algo: str) -> WorkerEntry:
        """The worker's entry, numbering it on first sight; block size and algorithm updated."""
        old = await self.client.hget(self.keys.workers, url)
        n = _entry(url, old).n if old else int(await self.client.incr(self.keys.wnext))
        entry = WorkerEntry(url, n, block_size, hash_algo)
        meta = json.dumps({"n": n, "block_size": block_size, "hash_algo": hash_algo})
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.workers, url, meta).hset(self.keys.wurl, str(n), url)
            await pipe.execute()
        return entry

    async def write(self, entry: WorkerEntry, diff: BlockDiff) -> None:
        """Apply one batch's diff atomically."""
        await self.write_many([(entry, diff)])

    async def write_many(self, diffs: Sequence[tuple[WorkerEntry, BlockDiff]]) -> None:
        """Apply consecutive batches' diffs, in order, in one script (one round trip, one
        command): a reader sees all of them or none, never part of a batch."""
        args: list[str | int] = [self.keys.block_prefix, f"{self.keys.prefix}:m:"]
        for entry, d in diffs:
            mapped = " ".join(f"{eh} {key}" for eh, key in d.mapped)
            args += [entry.n, int(d.cleared), "".join(d.hold), "".join(d.release), mapped,
                     " ".join(d.unmapped)]  # fmt: skip
        try:
            await self.client.evalsha(self._write_sha, 0, *args)
        except NoScriptError:  # nothing ran: load the script and send the same again
            await self.client.script_load(WRITE_LUA)
            await self.client.evalsha(self._write_sha, 0, *args)

    async def clear_prefix(self) -> int:
        """Delete every key under the prefix (the indexer owns it); returns how many."""
        n = 0
        async for batch in _batched(
            self.client.scan_iter(match=f"{self.keys.prefix}:*", count=1000)
        ):
            n += await self.client.unlink(*batch)
        return n

    async def held(self, entry: WorkerEntry) -> dict[str, str]:
        """Engine hash -> block key of everything `entry` holds in Redis."""
        raw = await self.client.hgetall(self.keys.owned(entry.n))
        return {_s(eh): _s(key) for eh, key in raw.items()}

    async def drop_blocks(self, entry: WorkerEntry, forget: bool = False) -> int:
        """Remove every block of the worker (and with `forget` its registration too) in one
        atomic script; returns how many blocks it held."""
        k = self.keys
        keys = [k.owned(entry.n), k.workers, k.wurl]
        args = [entry.n, k.block_prefix, entry.url if forget else ""]
        return int(await self._drop(keys=keys, args=args))

    async def drop(self, url: str) -> int:
        """Forget the worker entirely (blocks and registration); returns how many blocks."""
        raw = await self.client.hget(self.keys.workers, url)
        return 0 if raw is None else await self.drop_blocks(_entry(url, raw), forget=True)

    async def lookup(self, blobs: Sequence[str]) -> dict[str, int]:
        """Longest contiguous prefix, in blocks, per worker URL, for each `key_blob` (one per
        block size in the fleet), in one round trip."""
        blobs = [b for b in blobs if b]
        if not blobs:
            return {}
        try:
            replies = await self._evalsha_all(blobs)
        except NoScriptError:  # a restarted Redis forgot the script: load it once, ask again
            await self.client.script_load(LOOKUP_LUA)
            replies = await self._evalsha_all(blobs)
        return {_s(url): int(d) for flat in replies for url, d in _pairs(flat)}

    async def _evalsha_all(self, blobs: list[str]) -> list[Any]:
        # EVALSHA directly, not redis-py's Script in a pipeline: that adds a SCRIPT EXISTS
        # round trip to every call; and no pipeline at all for the usual single block size.
        args = (self._lookup_sha, 1, self.keys.wurl, self.keys.block_prefix)
        if len(blobs) == 1:
            return [await self.client.evalsha(*args, blobs[0])]
        async with self.client.pipeline(transaction=False) as pipe:
            for blob in blobs:
                pipe.evalsha(*args, blob)
            return await pipe.execute()


def block_id(key: int) -> str:
    """A block key as it appears in ``P:b:<key>``."""
    return f"{key:016x}"


def key_blob(keys: Sequence[int]) -> str:
    """A prompt's block keys as the lookup script's argument."""
    return struct.pack(f">{len(keys)}Q", *keys).hex()


async def _batched(keys: Any, size: int = 1000) -> Any:
    batch = []
    async for key in keys:
        batch.append(key)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _pairs(flat: Sequence[Any]) -> Iterable[tuple[Any, Any]]:
    return zip(flat[::2], flat[1::2])


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entry(url: str, raw: bytes | str) -> WorkerEntry:
    meta = json.loads(raw)
    return WorkerEntry(url, int(meta["n"]), int(meta["block_size"]), str(meta["hash_algo"]))
