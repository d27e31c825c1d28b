"""The Redis schema of the shared KV index against a real redis-server: batched writes, the
one-round-trip lookup of each worker's longest contiguous prefix, and complete drops."""

from __future__ import annotations

import asyncio

import pytest

redis_asyncio = pytest.importorskip("redis.asyncio")

from radixserve.router.kvindex.redis_store import BlockDiff, RedisIndexStore, block_id  # noqa: E402
from redis_harness import RedisServer  # noqa: E402


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


def run(redis_server, body):
    async def main():
        client = redis_asyncio.from_url(redis_server.url)
        await client.flushdb()
        try:
            return await body(RedisIndexStore(client), client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def K(name: str) -> str:
    """A block key (16 hex digits) for a readable name."""
    return block_id(int.from_bytes(name.encode().rjust(8, b"\0"), "big"))


def added(*names: str) -> BlockDiff:
    return BlockDiff(mapped=[(f"e{k}", K(k)) for k in names], hold=[K(k) for k in names])


def blob(*names: str) -> str:
    return "".join(map(K, names))


def test_lookup_is_each_workers_longest_contiguous_prefix(redis_server):
    async def body(store, client):
        a = await store.register("http://a", 16, "xxhash64")
        b = await store.register("http://b", 16, "xxhash64")
        await store.write(a, added("k1", "k2", "k3"))
        await store.write(b, added("k1", "k2", "k4"))  # holds k4 but not k3: a gap
        assert await store.lookup([blob("k1", "k2", "k3", "k4")]) == {"http://a": 3, "http://b": 2}
        assert await store.lookup([blob("k9", "k1")]) == {}  # must start at the first block
        assert await store.lookup([blob("k1")]) == {"http://a": 1, "http://b": 1}
        await store.write(a, BlockDiff(unmapped=["ek2"], release=[K("k2")]))
        assert await store.lookup([blob("k1", "k2", "k3")]) == {"http://a": 1, "http://b": 2}

    run(redis_server, body)


def test_one_call_answers_several_block_sizes(redis_server):
    async def body(store, client):
        a = await store.register("http://a", 16, "xxhash64")
        b = await store.register("http://b", 32, "xxhash64")
        await store.write(a, added("s16-1", "s16-2"))
        await store.write(b, added("s32-1"))
        got = await store.lookup([blob("s16-1", "s16-2"), blob("s32-1", "s32-2")])
        assert got == {"http://a": 2, "http://b": 1}

    run(redis_server, body)


def test_drop_leaves_nothing_of_the_worker(redis_server):
    async def body(store, client):
        a = await store.register("http://a", 16, "xxhash64")
        b = await store.register("http://b", 16, "xxhash64")
        await store.write(a, added("k1", "k2"))
        await store.write(b, added("k1"))
        assert await store.drop("http://a") == 2
        assert set(await store.workers()) == {"http://b"}
        assert await store.lookup([blob("k1", "k2")]) == {"http://b": 1}
        assert await client.exists("radixserve:b:" + K("k2")) == 0  # an empty set is no key at all
        assert await client.exists(f"radixserve:m:{a.n}") == 0
        assert await store.drop("http://a") == 0  # twice is harmless

    run(redis_server, body)


def test_cleared_batch_replaces_what_the_worker_held(redis_server):
    async def body(store, client):
        a = await store.register("http://a", 16, "xxhash64")
        await store.write(a, added("k1", "k2"))
        await store.write(a, BlockDiff(mapped=[("ex", K("x1"))], hold=[K("x1")], cleared=True))
        assert await store.lookup([blob("k1")]) == {}
        assert await store.lookup([blob("x1")]) == {"http://a": 1}
        assert await store.held(a) == {"ex": K("x1")}
        # registering again keeps the number (and so the entries) of a known worker
        assert (await store.register("http://a", 16, "xxhash64")).n == a.n

    run(redis_server, body)


def test_lookup_survives_a_redis_that_forgot_its_scripts(redis_server):
    async def body(store, client):
        a = await store.register("http://a", 16, "xxhash64")
        await store.write(a, added("k1"))
        await client.script_flush()
        assert await store.lookup([blob("k1")]) == {"http://a": 1}
        await client.script_flush()
        await store.write(a, BlockDiff(mapped=[("ex", K("x1"))], hold=[K("x1")], cleared=True))
        assert await store.held(a) == {"ex": K("x1")}

    run(redis_server, body)
