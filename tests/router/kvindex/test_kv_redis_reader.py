"""The router's reader of the shared KV index against a real redis-server: a worker the
kv-indexer registers between two of the router's table reads counts at once, also when Redis
came back empty and the table read then had no worker at all."""

from __future__ import annotations

import asyncio

import pytest

redis_asyncio = pytest.importorskip("redis.asyncio")

from radixserve.router.kvindex.block_index import block_keys  # noqa: E402
from radixserve.router.kvindex.redis_reader import KvsConfig, RedisIndexReader  # noqa: E402
from radixserve.router.kvindex.redis_store import BlockDiff, RedisIndexStore, block_id  # noqa: E402
from redis_harness import RedisServer  # noqa: E402

IDS = list(range(100, 164))  # 4 blocks of 16


def holding(keys: list[str]) -> BlockDiff:
    return BlockDiff(mapped=[(f"e{i}", k) for i, k in enumerate(keys)], hold=keys)


def test_a_worker_registered_after_the_table_was_read_counts_at_once():
    server = RedisServer()

    async def main() -> None:
        client = redis_asyncio.from_url(server.url)
        store = RedisIndexStore(client)
        reader = RedisIndexReader(KvsConfig(server.url), resolve=lambda url: url)
        keys = [block_id(k) for k in block_keys(IDS, 16)]
        try:
            await reader.prepare(IDS, "")  # nobody registered yet: Redis just (re)started
            assert reader.answer == {}
            await store.write(await store.register("http://a", 16, "xxhash64"), holding(keys[:1]))
            await reader.prepare(IDS, "")  # well within the table's refresh interval
            assert reader.answer == {"http://a": 16}
            await store.write(await store.register("http://b", 16, "xxhash64"), holding(keys))
            await reader.prepare(IDS, "")  # b is not in the table read a moment ago
            assert reader.answer == {"http://a": 16, "http://b": 64}
        finally:
            await reader.close()
            await client.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()
