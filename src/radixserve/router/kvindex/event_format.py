"""KV-cache events as a router reads them: the typed events and their parsing out of vLLM's wire
payload (msgpack of ``[ts, events, data_parallel_rank]``), in both encodings found in the wild.

Pure: bytes in, plain data out (the event structs are cache/kv_event_types.py's, which the
engine publishes). The subscriber (subscriber.py) receives the bytes; the index
(block_index.py) applies the events.
"""

# The two encodings of one event (issue 12; vLLM's KVEventBatch, SGLang's publisher):
#   tagged array  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
#                  lora_id, medium, lora_name, ...]   (older vLLM, SGLang)
#                 ["BlockRemoved", block_hashes, medium, ...]   ["AllBlocksCleared", ...]
#   map           {"type": "BlockStored", "block_hashes": [...], ..., "extra_keys": ...}
#                 (vLLM 0.32: 64-bit integer hashes, block_size 128 on CPU, extra keys such as
#                 "group_idx" and "kv_cache_spec_kind")
# Fields this router does not use (lora_id, trailing array fields, unknown map keys) are read
# past, never refused: a newer engine adding a field must not blind the router. An event of an
# unknown type is skipped for the same reason.

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.cache.kv_event_types import (  # noqa: F401  (re-exported: the router's events)
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KVEvent,
    namespace_string,
)

DEVICE_MEDIA = frozenset({None, "GPU", "gpu", "cuda", "CUDA", "device"})
"""Media whose blocks count as cached: vLLM tags blocks offloaded to CPU or disk with another
medium, and a prefill cannot reuse those without a transfer this router does not model."""


class EventFormatError(ValueError):
    """A payload that is not a KV-event batch."""


Event = KVEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: its timestamp, events in order, and data-parallel rank."""

    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None


def event_namespace(lora_name: Any, extra_keys: Any, n_blocks: int = 1) -> str:
    """Fold an event's namespace fields into one string. vLLM sends extra_keys per block (its
    cache_salt sits on the first block's keys, later blocks inherit it through the parent
    link): a list of one entry (a list or None) per block is read by its first entry; anything
    else is taken whole."""
    if _per_block(extra_keys, n_blocks):
        extra_keys = extra_keys[0]
    return namespace_string(lora_name if isinstance(lora_name, str) else None, _flat(extra_keys))


def _per_block(keys: Any, n_blocks: int) -> bool:
    if not isinstance(keys, list | tuple) or len(keys) != n_blocks or not keys:
        return False
    return all(k is None or isinstance(k, list | tuple) for k in keys)


def _flat(keys: Any) -> str | None:
    if keys is None or keys == [] or keys == ():
        return None
    if isinstance(keys, list | tuple):
        return "\x1f".join(str(k) for k in keys)
    return str(keys)


def parse_payload(payload: bytes) -> EventBatch:
    """Decode one message payload; raises EventFormatError when it is not an event batch."""
    import msgpack  # the one decoder; imported here so that the index stays importable bare

    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventFormatError(f"not msgpack: {exc}") from None
    return parse_batch(obj)


def parse_batch(obj: Any) -> EventBatch:
    """An event batch out of its decoded form ``[ts, events, dp_rank]`` (dp_rank optional)."""
    if not isinstance(obj, list | tuple) or len(obj) < 2 or not isinstance(obj[1], list | tuple):
        raise EventFormatError("an event batch is [ts, events, data_parallel_rank]")
    ts = obj[0] if isinstance(obj[0], int | float) else 0.0
    rank = obj[2] if len(obj) > 2 and isinstance(obj[2], int) else None
    events = tuple(e for e in map(parse_event, obj[1]) if e is not None)
    return EventBatch(float(ts), events, rank)


def parse_event(obj: Any) -> Event | None:
    """One event in either encoding; None for an event type this router does not know."""
    if isinstance(obj, dict):
        kind, fields = obj.get("type"), obj
    elif isinstance(obj, list | tuple) and obj and isinstance(obj[0], str):
        kind, fields = obj[0], _array_fields(obj[0], obj[1:])
    else:
        raise EventFormatError(f"an event is a tagged array or a map, not {type(obj).__name__}")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes")), _medium(fields))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
}


def _array_fields(kind: str, values: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(_ARRAY_FIELDS.get(kind, ()), values))


def _stored(f: dict[str, Any]) -> BlockStored:
    hashes = _hashes(f.get("block_hashes"))
    try:  # one C pass checks and packs them
        tokens = array("q", f.get("token_ids"))  # type: ignore[arg-type]
    except (TypeError, OverflowError):
        raise EventFormatError("BlockStored.token_ids must be a list of 64-bit ints") from None
    size = f.get("block_size")
    if not isinstance(size, int) or size < 1:
        raise EventFormatError("BlockStored.block_size must be a positive int")
    parent = f.get("parent_block_hash")
    if parent is not None and not isinstance(parent, int | bytes | str):
        raise EventFormatError("BlockStored.parent_block_hash must be a hash or null")
    ns = event_namespace(f.get("lora_name"), f.get("extra_keys"), len(hashes))
    return BlockStored(hashes, parent, tokens, size, ns, _medium(f))


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(h, int | bytes | str) for h in value
    ):
        raise EventFormatError("block_hashes must be a list of ints, bytes or strings")
    return tuple(value)


def _medium(f: dict[str, Any]) -> str | None:
    medium = f.get("medium")
    return medium if isinstance(medium, str) else None
