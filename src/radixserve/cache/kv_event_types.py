"""The KV-cache events one engine's cache announces and every router reads: BlockStored,
BlockRemoved, AllBlocksCleared, and the encoding of a cache namespace in them. One declaration
for both sides: the engine's BlockTracker (block_events.py) builds them, the router's parser
(router/kvindex/event_format.py) decodes them from the wire, its index applies them.

Pure: no I/O. ``wire()`` gives the map vLLM publishes (field order as vLLM declares it).

Namespaces. An event's ``namespace`` is one string: the LoRA adapter's name and the cache salt
joined by "\\x1f" (trailing separators dropped; see namespace_string). On vLLM's wire the same
thing travels as ``lora_name`` and ``extra_keys``, one entry per block, the cache salt on the
first block of a namespace (its chain's root) and inherited by later blocks through the parent
link; ``lora_name`` / ``extra_keys`` below derive that form, the parser folds it back.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

EngineHash = int | bytes | str
"""A block hash as an engine publishes it; only ever compared for equality."""

MEDIUM = "GPU"
"""vLLM's name for the engine's own KV pool, whatever the device."""

MEDIUM_HOST = "CPU"
"""vLLM's name (its CPU offloading's) for host memory: blocks in the host KV tier."""

_SEP = "\x1f"


def namespace_string(lora_name: str | None = None, salt: str | None = None) -> str:
    """The namespace of a request's blocks: LoRA adapter and cache salt in one string. A request
    and the events its blocks cause agree on it, which is what keeps namespaces apart in the
    router's index and its approximate tree."""
    parts = [lora_name or "", *([salt] if salt else [])]
    return _SEP.join(parts).rstrip(_SEP)


def engine_namespace(namespace: Hashable | None) -> str:
    """namespace_string of one of this project's engine cache namespaces: ``"lora:<name>"``,
    ``"salt:<cache_salt>"``, any other value taken as a salt, None for none."""
    ns = "" if namespace is None else str(namespace)
    if ns.startswith("lora:"):
        return namespace_string(ns[len("lora:") :])
    return namespace_string(None, ns.removeprefix("salt:") or None)


def wire_namespace(namespace: str) -> tuple[str | None, list[str] | None]:
    """(lora_name, the first block's extra_keys entry) of a namespace_string."""
    lora, _, salt = namespace.partition(_SEP)
    return (lora or None), ([salt] if salt else None)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks entered the engine's cache: ``token_ids`` holds ``block_size`` tokens per
    hash, the first block's parent is ``parent_block_hash`` (None: the root of a namespace's
    chain). ``medium`` None: not said (counts as the engine's own pool)."""

    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    namespace: str = ""
    medium: str | None = None

    @property
    def lora_name(self) -> str | None:
        return wire_namespace(self.namespace)[0]

    @property
    def extra_keys(self) -> list[Any]:
        """Per block: the cache salt on the first block of a chain, None after it."""
        extra: list[Any] = [None] * len(self.block_hashes)
        if self.parent_block_hash is None and extra:
            extra[0] = wire_namespace(self.namespace)[1]
        return extra

    def wire(self) -> dict[str, Any]:
        """The map vLLM publishes (field order as vLLM declares it)."""
        return {"type": "BlockStored", "block_hashes": _listed(self.block_hashes),
                "parent_block_hash": self.parent_block_hash,
                "token_ids": _listed(self.token_ids), "block_size": self.block_size,
                "lora_id": None, "medium": self.medium or MEDIUM, "lora_name": self.lora_name,
                "extra_keys": self.extra_keys, "group_idx": 0,
                "kv_cache_spec_kind": "full_attention"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the engine's cache (evicted)."""

    block_hashes: Sequence[EngineHash]
    medium: str | None = None

    def wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": _listed(self.block_hashes),
                "medium": self.medium or MEDIUM, "group_idx": 0}  # fmt: skip


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (``/flush_cache``, a reset)."""

    def wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _listed(values: Sequence[Any]) -> list[Any]:
    return values if isinstance(values, list) else list(values)
