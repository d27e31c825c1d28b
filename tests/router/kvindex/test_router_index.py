"""The precise prefix index: events in (both encodings), per-worker contiguous prefixes out."""

from __future__ import annotations

import msgpack
import pytest

from radixserve.router.kvindex.block_index import InMemoryIndex, block_keys, chain_keys
from radixserve.router.kvindex.event_format import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    namespace_string,
    parse_payload,
)

BS = 4
PROMPT = list(range(100, 124))  # 6 blocks of 4


def stored(hashes, parent, tokens, ns="", medium="GPU"):
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, ns, medium)


def matched(index, worker, prompt=PROMPT, ns=""):
    got = index.prefix_tokens([worker], lambda n: block_keys(prompt, n, ns))
    return got.get(worker)


def test_chain_keys_equal_block_keys_of_the_whole_prompt():
    first = chain_keys(None, PROMPT[:8], BS)
    rest = chain_keys(first[-1], PROMPT[8:], BS)
    assert first + rest == block_keys(PROMPT, BS)


def test_foreign_hashes_are_rekeyed_and_matched_contiguously():
    index = InMemoryIndex()
    # hashes the router cannot reproduce: opaque byte strings
    index.apply("w", [stored([b"a", b"b"], None, PROMPT[:8])])
    index.apply("w", [stored([b"c"], b"b", PROMPT[8:12])])
    assert matched(index, "w") == 12
    assert matched(index, "w", PROMPT[:4] + [9, 9, 9, 9] + PROMPT[8:]) == 4
    index.apply("w", [BlockRemoved((b"b",), "GPU")])
    assert matched(index, "w") == 4  # block 3 without its parent is no hit
    assert index.blocks() == {"w": 2}
    index.check_integrity()


def test_unknown_parent_is_an_orphan_and_unknown_worker_is_absent():
    index = InMemoryIndex()
    assert matched(index, "w") is None
    index.apply("w", [stored([1], 999, PROMPT[:4])])
    assert index.stats.orphans == 1 and matched(index, "w") == 0


def test_namespaces_never_mix():
    index = InMemoryIndex()
    salted = namespace_string(None, "salt:x")
    index.apply("w", [stored([1, 2], None, PROMPT[:8], ns=salted)])
    assert matched(index, "w") == 0
    assert matched(index, "w", ns=salted) == 8


def test_clear_drop_and_block_size_change_forget_the_worker():
    index = InMemoryIndex()
    index.apply("w", [stored([1, 2], None, PROMPT[:8])])
    index.apply("w", [AllBlocksCleared()])
    assert matched(index, "w") == 0 and index.blocks() == {"w": 0}
    index.apply("w", [stored([1, 2], None, PROMPT[:8])])
    index.apply("w", [BlockStored((7,), None, tuple(PROMPT[:8]), 8)])  # now 8 tokens a block
    assert index.block_size("w") == 8 and index.blocks() == {"w": 1}
    index.drop_worker("w")
    assert index.blocks() == {}


def test_removed_blocks_count_what_a_worker_really_removed():
    index = InMemoryIndex()
    index.apply("w", [stored([1, 2, 3], None, PROMPT[:12])])
    assert index.removed_blocks("w") == 0
    index.apply("w", [BlockRemoved((3, 2)), BlockRemoved((99,))])  # 99: never stored
    assert index.removed_blocks("w") == 2 and index.blocks() == {"w": 1}
    index.apply("w", [BlockRemoved((1,), "CPU")])  # an offloaded copy left: still held
    assert index.removed_blocks("w") == 2
    index.drop_worker("w")
    assert index.removed_blocks("w") == 0


def test_distinct_blocks_count_a_block_held_twice_once():
    index = InMemoryIndex()
    index.apply("a", [stored([1, 2, 3], None, PROMPT[:12])])
    index.apply("b", [stored([7, 8], None, PROMPT[:8])])  # its own hashes, the same tokens
    index.apply("b", [stored([9], None, PROMPT[20:24])])
    assert index.blocks() == {"a": 3, "b": 3} and index.distinct_blocks() == 4
    index.apply("a", [BlockRemoved((3, 2))])
    assert index.distinct_blocks() == 3


def test_offloaded_media_do_not_count():
    index = InMemoryIndex()
    index.apply("w", [stored([1, 2], None, PROMPT[:8], medium="CPU")])
    assert matched(index, "w") is None


def test_duplicate_engine_hashes_keep_counts_exact():
    index = InMemoryIndex()
    index.apply("w", [stored([1], None, PROMPT[:4]), stored([1], None, PROMPT[:4])])
    index.apply("w", [stored([2], None, PROMPT[:4])])  # same tokens, another engine hash
    index.apply("w", [BlockRemoved((1,))])
    assert matched(index, "w") == 4
    index.check_integrity()


def test_both_encodings_parse_and_extra_fields_are_ignored():
    arr = ["BlockStored", [11, 12], None, PROMPT[:8], BS, 3, "GPU", None, "extra", 7]
    amap = {
        "type": "BlockStored",
        "block_hashes": [13],
        "parent_block_hash": 12,
        "token_ids": PROMPT[8:12],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    batch = parse_payload(msgpack.packb([1.5, [arr, amap, ["Unknown", 1]], 0]))
    assert batch.dp_rank == 0 and len(batch.events) == 2
    index = InMemoryIndex()
    index.apply("w", batch.events)
    assert matched(index, "w") == 12


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([0, [["BlockStored", "x"]]])],
)
def test_malformed_payloads_raise_format_errors(payload):
    with pytest.raises(EventFormatError):
        parse_payload(payload)


def test_per_block_extra_keys_carry_the_salt_on_the_first_block():
    amap = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": PROMPT[:4], "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [["tenant-a"]]}  # fmt: skip
    batch = parse_payload(msgpack.packb([0.0, [amap]]))
    assert batch.events[0].namespace == namespace_string(None, "tenant-a")
    amap |= {"block_hashes": [1, 2], "token_ids": PROMPT[:8], "extra_keys": [["t"], None]}
    assert parse_payload(msgpack.packb([0.0, [amap]])).events[0].namespace == "\x1ft"


# ----- lower media (vLLM's `medium`: "CPU" is its host offload tier) --------------------------------


def loadable(index, worker, prompt=PROMPT):
    return index.lower_tokens([worker], lambda n: block_keys(prompt, n)).get(worker)


def test_host_blocks_are_kept_apart_and_answer_lower_tokens():
    index = InMemoryIndex()
    index.apply("w", [stored([1, 2, 3], None, PROMPT[:12])])
    index.apply("w", [stored([1, 2, 3], None, PROMPT[:12], medium="CPU")])
    index.apply("w", [BlockRemoved((2, 3), "GPU")])  # evicted from device, still on host
    assert matched(index, "w") == 4
    assert loadable(index, "w") == 12
    assert index.lower_blocks() == {"w": {"CPU": 3}} and index.blocks() == {"w": 1}
    index.apply("w", [BlockRemoved((3,), "CPU")])
    assert loadable(index, "w") == 8
    index.check_integrity()


def test_hash_only_offload_events_are_keyed_by_the_device_block_they_copy():
    # vLLM's CPU offloading announces stored blocks by hash, without token ids or parent
    index = InMemoryIndex()
    index.apply("w", [stored([7, 8], None, PROMPT[:8])])
    index.apply("w", [BlockStored((7, 8, 99), None, (), BS, "", "CPU")])  # 99: never on device
    index.apply("w", [BlockRemoved((7, 8))])
    assert matched(index, "w") == 0 and loadable(index, "w") == 8
    assert index.stats.orphans == 1


def test_a_run_may_mix_device_and_host_blocks_and_a_host_parent_chains():
    index = InMemoryIndex()
    index.apply("w", [stored([1], None, PROMPT[:4])])  # block 0 on device only
    # blocks 1-2 offloaded with token ids, their parent (block 0) found on device
    index.apply("w", [stored([2, 3], 1, PROMPT[4:12], medium="cpu")])
    assert matched(index, "w") == 4 and loadable(index, "w") == 12
    index.apply("w", [AllBlocksCleared()])  # the device pool's reset: the host keeps its own
    assert matched(index, "w") == 0 and loadable(index, "w") is None  # its run starts at 1
    index.drop_worker("w")
    assert index.lower_blocks() == {}
