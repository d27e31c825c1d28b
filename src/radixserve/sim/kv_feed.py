"""The simulator's event plane: each simulated engine's radix cache announces its blocks through
the engine's own BlockTracker, and the router's index reads them, in process and without delay.
Owns nothing but the wiring; the tracker, the wire form and the index are the real ones."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.cache.block_events import BlockTracker
from radixserve.cache.radix import RadixCache
from radixserve.router.kvindex.block_index import BlockIndex
from radixserve.router.kvindex.event_format import parse_event

BLOCK_SIZE = 16
"""Tokens per announced block: the engine's default (``--kv-events-config``)."""


class KvFeed:
    """Engine ``i``'s events go into ``index`` as worker ``i`` (the simulator's worker ids)."""

    def __init__(
        self, caches: Sequence[RadixCache], index: BlockIndex, block_size: int = BLOCK_SIZE
    ) -> None:
        self.index = index
        self.trackers = [BlockTracker(cache, block_size) for cache in caches]

    def flush(self) -> None:
        """Apply every event the engines' caches produced since the last call. Each goes
        through its wire form (the map the publisher sends) and the router's parser."""
        for worker, tracker in enumerate(self.trackers):
            if tracker.pending:
                wire = (event.wire() for event in tracker.take())
                self.index.apply(worker, [e for e in map(parse_event, wire) if e is not None])
