"""PURE: the interface of a lower KV tier as kv_aware reads it: per worker, how many leading
tokens of the request being routed it could load instead of computing (from its host tier, or
from a KV store every worker reads, such as Mooncake Store through its master's metadata)."""

# A source answers for the request its owner last prepared (the I/O happens before `select`,
# outside the policy, as for the Redis index); None means it cannot answer now (its service is
# down and gated): kv_aware then scores from device holdings and the approximate tree alone.

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Protocol

KeysFor = Callable[[int], Sequence[int]]  # block size -> the request's block keys (block_index)


class LowerHoldings(Protocol):
    """What HostTier reads of an event index (block_index.BlockIndex has both)."""

    def answering(self) -> bool: ...
    def lower_tokens(
        self, workers: Iterable[Hashable], keys_for: KeysFor
    ) -> dict[Hashable, int]: ...


class TierSource(ABC):
    """Leading prompt tokens each worker can load from a lower tier: its own host tier
    (``tier`` "host") or a KV store ("store"), each priced at the ratio the worker reports
    for it."""

    name: str = "lower"
    tier: str = "store"

    @abstractmethod
    def loadable_tokens(
        self, workers: Iterable[Hashable], keys_for: KeysFor
    ) -> dict[Hashable, int] | None:
        """For each worker among ``workers`` that can load some of the prompt, how many leading
        tokens; None when the source cannot answer. ``keys_for`` gives the request's router
        block keys at a block size, for a source that indexes blocks from KV events (a host
        tier announced with vLLM's ``medium``); a source that looked the request up itself
        (the KV store's metadata) ignores it."""


class FixedTier(TierSource):
    """A source answering from a fixed map (the simulator's, and tests'); None: down."""

    def __init__(self, tokens: Mapping[Hashable, int] | None = None, name: str = "fixed") -> None:
        self.tokens, self.name = tokens, name

    def loadable_tokens(
        self, workers: Iterable[Hashable], keys_for: KeysFor | None = None
    ) -> dict[Hashable, int] | None:
        if self.tokens is None:
            return None
        return {w: self.tokens[w] for w in workers if self.tokens.get(w)}


class HostTier(TierSource):
    """The workers' own lower tiers as their KV events announce them (blocks stored with a
    medium other than the device's, such as vLLM's "CPU" offload tier), read from the event
    index: per worker, the leading prompt tokens it holds on device or there."""

    name = tier = "host"

    def __init__(self, index: LowerHoldings) -> None:
        self.index = index

    def loadable_tokens(
        self, workers: Iterable[Hashable], keys_for: KeysFor
    ) -> dict[Hashable, int] | None:
        if not self.index.answering():
            return None
        return self.index.lower_tokens(workers, keys_for)
