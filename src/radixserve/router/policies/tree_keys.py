"""The approximate tree's byte keys: a request's prompt packed into the key the router's prefix
tree (tree.py) matches on.
Owns the key format (8-byte units), the text and token-id encoders, and the namespace tuple."""

# Why raw bytes and not hashed blocks: hashing 16-character blocks costs one Python-level call
# per block (about 90 us for an 8,000-character prompt on a small VM), which alone would blow the
# router's per-request budget, while `str.encode` plus a C-level slice compare costs about 2 us.
# Exact units also never collide. Memory stays bounded by `max_tree_size` (config.py), counted
# in units, so it does not depend on the script; where long non-ASCII prompts make 8 bytes hold
# only 2-4 characters, `text_key(..., block_chars=16)` trades CPU for reach by hashing each block
# of characters into one unit.

from __future__ import annotations

from array import array
from collections.abc import Sequence

from radixserve.cache.kv_event_types import namespace_string

UNIT = 8
"""Bytes per key unit: the tree's granularity and the unit of `max_tree_size`."""

Namespace = tuple[str, ...]
"""(key kind, model, namespace_string(LoRA adapter, cache salt)): requests in different
namespaces never match."""

_PAD = b"\0" * UNIT
# An id no vocabulary reaches, so a padded odd-length key never equals a real token pair.
_ID_PAD = 0xFFFFFFFF


def _pad(raw: bytes) -> bytes:
    rem = len(raw) % UNIT
    return raw + _PAD[rem:] if rem else raw


def text_key(text: str, block_chars: int = 0) -> bytes:
    """Key for a text prompt: UTF-8 bytes in 8-byte units (8 ASCII characters per unit).

    With `block_chars > 0` each block of that many characters becomes one hashed unit instead;
    the builtin hash is enough because the tree lives in one process and is never persisted.
    """
    if block_chars <= 0:
        return _pad(text.encode("utf-8"))
    starts = range(0, len(text), block_chars)
    ends = range(block_chars, len(text) + block_chars, block_chars)
    blocks = map(text.__getitem__, map(slice, starts, ends))
    return array("q", map(hash, blocks)).tobytes()


def ids_key(ids: Sequence[int]) -> bytes:
    """Key for token ids: two 32-bit ids packed exactly per unit (no hashing, no collisions).

    Raises ValueError for an id that is not an int in [0, 2**32).
    """
    try:
        packed = array("I", ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if len(packed) % 2:
        packed.append(_ID_PAD)
    return packed.tobytes()


def namespace(kind: str, model: str = "", lora: str = "", cache_salt: str = "") -> Namespace:
    """The namespace an engine caches under; `kind` keeps text keys and id keys apart. LoRA
    adapter and cache salt are encoded as in the KV events (namespace_string)."""
    return (kind, model, namespace_string(lora, cache_salt))


def units(key: bytes) -> int:
    """Length of a key in units."""
    return len(key) // UNIT
