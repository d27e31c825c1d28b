"""The publisher's payload equals, byte for byte, what msgspec makes of structs declared the way
vLLM declares its KV events today (map-encoded events tagged "type" with omit_defaults, inside
an array-encoded batch), and vLLM-style typed decoding reads it back."""

from __future__ import annotations

import itertools

import pytest

from radixserve.cache.block_events import BlockTracker
from radixserve.cache.radix import RadixCache
from radixserve.config import CacheConfig
from radixserve.engine.kv_events import encode_batch

msgspec = pytest.importorskip("msgspec")


# Declared from vLLM's published schema (field names, order, defaults, struct options).
class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(Event):
    pass


class EventBatch(Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def tracked_events() -> list:
    cache = RadixCache(CacheConfig(max_total_tokens=1 << 16))
    tracker = BlockTracker(cache, 4)
    slots = itertools.count()
    for toks, ns in (([1, 2, 3, 4, 5, 6, 7, 8, 9], "salt:t"), ([1, 2, 3, 4, 5, 6, 7, 8], None),
                     ([1, 2, 3, 4, 9, 9, 9, 9], None)):  # fmt: skip
        cache.insert(toks, [next(slots) for _ in toks], ns)
    cache.evict(4)
    tracker.clear()
    return tracker.take()


def as_vllm(ev) -> Event:
    w = ev.wire()
    kind = w.pop("type")
    if kind == "BlockStored":
        w["extra_keys"] = [None if k is None else tuple(k) for k in w["extra_keys"]]
    return {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
            "AllBlocksCleared": AllBlocksCleared}[kind](**w)  # fmt: skip


def test_the_payload_is_byte_for_byte_what_vllms_structs_encode():
    events = tracked_events()
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["BlockStored", "BlockStored", "BlockStored", "BlockRemoved",
                     "AllBlocksCleared"]  # fmt: skip
    ts = 1790000000.25
    ours = encode_batch(ts, events)
    theirs = msgspec.msgpack.encode(EventBatch(ts, [as_vllm(e) for e in events], 0))
    assert ours == theirs


def test_vllms_typed_decoder_reads_the_payload():
    events = tracked_events()
    decoded = msgspec.msgpack.decode(encode_batch(1.5, events), type=EventBatch)
    assert decoded.data_parallel_rank == 0 and decoded.ts == 1.5
    stored = decoded.events[0]
    assert isinstance(stored, BlockStored) and stored.extra_keys == [("t",), None]
    assert stored.block_hashes == events[0].block_hashes and stored.medium == "GPU"
    assert isinstance(decoded.events[-1], AllBlocksCleared)
