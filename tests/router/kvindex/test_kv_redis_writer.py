"""The kv-indexer's index (RedisIndexWriter) against a real redis-server: what the routers read
from Redis equals what the in-memory index answers for the same events, through removals,
clears, shared keys, a forgotten worker, and a Redis that restarts empty."""

from __future__ import annotations

import asyncio
import random

import pytest

redis_asyncio = pytest.importorskip("redis.asyncio")

from radixserve.router.kvindex.block_index import InMemoryIndex, block_keys  # noqa: E402
from radixserve.router.kvindex.event_format import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from radixserve.router.kvindex.redis_store import RedisIndexStore, block_id, key_blob  # noqa: E402
from radixserve.router.kvindex.redis_writer import RedisIndexWriter  # noqa: E402
from redis_harness import RedisServer  # noqa: E402

BS = 4


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


def stored(tokens, engine_hashes, parent=None, ns=""):
    return BlockStored(tuple(engine_hashes), parent, tuple(tokens), BS, ns)


async def redis_view(store, prompts, ns=""):
    """Per prompt, tokens matched per worker as Redis answers it."""
    out = []
    workers = await store.workers()
    for p in prompts:
        got = await store.lookup([key_blob(block_keys(p, BS, ns))])
        out.append({url: got.get(url, 0) * w.block_size for url, w in workers.items()})
    return out


def memory_view(index, prompts, workers, ns=""):
    return [index.prefix_tokens(workers, lambda bs, p=p: block_keys(p, bs, ns)) for p in prompts]


def with_writer(redis_server, body):
    async def main():
        client = redis_asyncio.from_url(redis_server.url)
        writer = RedisIndexWriter(RedisIndexStore(client), retry_secs=0.05)
        task = asyncio.create_task(writer.run())
        try:
            return await body(writer, client)
        finally:
            task.cancel()
            await client.aclose()

    return asyncio.run(main())


def random_batches(rng, n_batches=60):
    """Random stores (with foreign, unreproducible engine hashes) and removals on two workers."""
    held = {"http://a": [], "http://b": []}
    for step in range(n_batches):
        worker = rng.choice(list(held))
        chain = held[worker]
        if chain and rng.random() < 0.3:
            k = rng.randint(1, len(chain))
            gone, held[worker] = chain[-k:], chain[:-k]
            yield worker, [BlockRemoved(tuple(h for h, _ in gone))]
            continue
        parent = chain[-1][0] if chain else None
        base = chain[-1][1] if chain else []
        n = rng.randint(1, 3)
        tokens = [rng.randint(0, 3) for _ in range(n * BS)]
        hashes = [rng.getrandbits(63) for _ in range(n)]
        yield worker, [stored(tokens, hashes, parent)]
        for i, h in enumerate(hashes):
            chain.append((h, base + tokens[: (i + 1) * BS]))
            base = chain[-1][1]
        if step == n_batches // 2:
            yield worker, [AllBlocksCleared()]
            held[worker] = []


def test_redis_answers_what_the_in_memory_index_answers(redis_server):
    rng = random.Random(7)
    batches = list(random_batches(rng))
    prompts = [[rng.randint(0, 3) for _ in range(4 * BS)] for _ in range(300)]
    prompts += [toks for _, evs in batches for e in evs if isinstance(e, BlockStored)
                for toks in [list(e.token_ids)]]  # fmt: skip
    reference = InMemoryIndex()

    async def body(writer, client):
        for worker, events in batches:
            reference.apply(worker, events)
            writer.apply(worker, events)
        assert await writer.flushed()
        workers = ["http://a", "http://b"]
        assert await redis_view(writer.store, prompts) == memory_view(reference, prompts, workers)
        assert any(memory_view(reference, prompts, workers))  # the comparison is not vacuous

    with_writer(redis_server, body)


def test_shared_key_survives_one_of_its_engine_hashes_leaving(redis_server):
    async def body(writer, client):
        toks = [1, 2, 3, 4]
        writer.apply("http://a", [stored(toks, [11]), stored(toks, [12])])
        writer.apply("http://a", [BlockRemoved((11,))])
        assert await writer.flushed()
        assert await redis_view(writer.store, [toks]) == [{"http://a": BS}]
        writer.apply("http://a", [BlockRemoved((12,))])
        assert await writer.flushed()
        assert await redis_view(writer.store, [toks]) == [{"http://a": 0}]
        assert not await client.exists("radixserve:b:" + block_id(block_keys(toks, BS)[0]))

    with_writer(redis_server, body)


def test_forgotten_worker_leaves_no_key_behind(redis_server):
    async def body(writer, client):
        writer.apply("http://a", [stored([1, 2, 3, 4, 5, 6, 7, 8], [1, 2])])
        writer.apply("http://b", [stored([1, 2, 3, 4], [9])])
        assert await writer.flushed()
        writer.drop_worker("http://a")
        assert await writer.flushed()
        assert await redis_view(writer.store, [[1, 2, 3, 4, 5, 6, 7, 8]]) == [{"http://b": BS}]
        assert await redis_view(writer.store, [[9, 9, 9, 9]]) == [{"http://b": 0}]
        keys = {k.decode() async for k in client.scan_iter("radixserve:*")}
        assert set(await writer.store.workers()) == {"http://b"}
        n = writer.entries["http://b"].n
        assert keys == {"radixserve:workers", "radixserve:wurl", "radixserve:wnext",
                        f"radixserve:m:{n}", "radixserve:b:" + block_id(block_keys([1, 2, 3, 4], BS)[0])}  # fmt: skip

    with_writer(redis_server, body)


def test_redis_restarted_empty_is_rewritten_from_the_mirror(redis_server):
    async def body(writer, client):
        toks = list(range(12))
        writer.apply("http://a", [stored(toks, [1, 2, 3])])
        assert await writer.flushed()
        redis_server.kill()
        writer.apply("http://a", [BlockRemoved((3,))])  # while Redis is down
        await asyncio.sleep(0.2)
        assert writer.ops and not writer.redis_ok
        redis_server.start()
        deadline = asyncio.get_running_loop().time() + 10
        while await redis_view(writer.store, [toks]) != [{"http://a": 2 * BS}]:
            assert asyncio.get_running_loop().time() < deadline, "Redis was not rewritten"
            await asyncio.sleep(0.05)
        assert writer.rewrites == 1

    with_writer(redis_server, body)


def test_a_router_reads_the_index_under_the_indexers_prefix(redis_server):
    from radixserve.router.proxy.config import RouterConfig
    from radixserve.router.proxy.kv_setup import open_kv_index

    toks = [5, 6, 7, 8] * 2

    def config(*prefix: str) -> RouterConfig:
        extra = {"redis_prefix": prefix[0]} if prefix else {}
        return RouterConfig(worker_urls=("http://a",), policy="kv_aware",
                            kv_index=redis_server.url, **extra)  # fmt: skip

    async def main():
        client = redis_asyncio.from_url(redis_server.url)
        writer = RedisIndexWriter(RedisIndexStore(client, "team2"), retry_secs=0.05)
        task = asyncio.create_task(writer.run())
        try:
            writer.apply("http://a", [stored(toks, [1, 2])])
            assert await writer.flushed()
            seen = []
            for cfg in (config("team2"), config()):
                reader, _policy = open_kv_index(cfg, lambda url: url)
                await reader.prepare(toks, "")
                seen.append(reader.prefix_tokens(["http://a"], lambda bs: block_keys(toks, bs)))
                await reader.close()
            return seen
        finally:
            task.cancel()
            await client.aclose()

    under_prefix, default = asyncio.run(main())
    assert under_prefix == {"http://a": 8}
    assert default == {}  # another prefix: another index, nothing known there


def test_redis_only_flags_are_refused_with_the_memory_index():
    from radixserve.router.proxy.config import RouterConfig

    with pytest.raises(ValueError, match="--redis-prefix"):
        RouterConfig(worker_urls=("http://a",), policy="kv_aware", redis_prefix="x")
