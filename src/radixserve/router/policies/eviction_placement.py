"""kv_aware's placement while the fleet evicts: which workers removed blocks lately, and the
worker with the smallest footprint for a request every eligible worker holds equally. Pure."""

# Placement while the fleet evicts. A request every eligible worker holds equally and partly
# (a system prompt they all have, nothing more of it anywhere) has no holder to prefer, and the
# kv_aware's score would send it to the least queued worker. While some eligible worker has removed
# blocks in the last EVICTING_SECS (the index counts removals per worker; the policy dates a
# change of that count at the decision that sees it), such a request instead goes to the worker
# with the smallest footprint: tokens it holds (the index's blocks times its block size) plus
# HELD_PENDING_WEIGHT x its queued prefill, among workers whose queue is within
# HELD_QUEUE_SPAN prompts of the shortest; footprints within one prompt of the smallest count
# as equal and go to the worker sent fewest requests lately (a vLLM cache, once warm, is always
# full: its holdings are its capacity give or take a block, and chasing that block would pile
# every new session onto the worker a block emptier). Under eviction pressure the worker
# holding least has the most room, so a new session placed there evicts least of what other sessions' next turns
# will hit: on simulated multi-turn chat at a tenth of the KV pool this took kv_aware from
# 1.1-2.4 points below cache_aware to 1.1-3.3 above, at a lower TTFT p99
# (benchmarks/kv_aware_sweep.py). While nothing is evicted, holdings count finished sessions
# rather than live ones: applied then too, the rule lost 2.3 points at a quarter of the pool
# (benchmarks/kv_aware_headroom.py). It needs per-worker holdings, which the in-memory index
# has; an index that reports none (Redis, as the router reads it) leaves the score to decide.

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from radixserve.router.kvindex.block_index import BlockIndex
from radixserve.router.policies.base import WorkerView
from radixserve.router.policies.inflight import INFLIGHT_BLOCK
from radixserve.router.policies.pending import PendingPrefill
from radixserve.router.policies.shares import DispatchShares

EVICTING_SECS = 2.0
"""How long after a worker's last removal the fleet counts as evicting (see the header)."""
HELD_PENDING_WEIGHT = 0.5
HELD_QUEUE_SPAN = 8
"""Placement by holdings skips workers whose queued prefill exceeds the shortest queue by more
than this many prompts: on chat at a tenth of the pool, without it TTFT p99 rose above
cache_aware's (1.45 s against 1.30 s); spans of 0.5-2 prompts gave back 0.7-2.2 of the 3.3
points it gained there."""


class EvictionPlacement:
    """Dates each worker's latest removals (from the index's per-worker counts) and places a
    request all eligible workers hold equally and partly while any of them evicts."""

    def __init__(self, index: BlockIndex, pending: PendingPrefill, shares: DispatchShares) -> None:
        self.index = index
        self._pending = pending  # the policy's own: queued prefill per worker
        self._shares = shares  # the policy's own: requests sent lately per worker
        self._removals: dict[Hashable, tuple[int, float]] = {}  # worker -> (count, seen at)

    def evicting(self, worker: Hashable, now: float) -> bool:
        """Whether `worker` removed blocks within EVICTING_SECS of `now` (dates every change
        of its count it sees)."""
        count = self.index.removed_blocks(worker)
        seen = self._removals.get(worker)
        if seen is None or seen[0] != count:
            seen = self._removals[worker] = (count, now if count or seen else -math.inf)
        return now - seen[1] < EVICTING_SECS

    def place(
        self,
        workers: Sequence[WorkerView],
        eligible: list[int],
        cached: dict[Hashable, int],
        size: int,
    ) -> int | None:
        """The worker with the smallest footprint, for a request all eligible workers hold
        equally and partly (the fleet evicts); None to leave it to the score."""
        ids = [workers[i].id for i in eligible]
        levels = {cached.get(w, 0) for w in ids}
        if len(levels) != 1 or not levels.pop():
            return None
        held = self.index.blocks()
        if any(w not in held for w in ids):
            return None  # a worker the index does not know: its holdings are a guess
        queues = {i: self._pending.tokens(workers[i]) for i in eligible}
        limit = min(queues.values()) + HELD_QUEUE_SPAN * size

        def footprint(i: int) -> float:
            tokens = held[workers[i].id] * (self.index.block_size(workers[i].id) or INFLIGHT_BLOCK)
            return tokens + HELD_PENDING_WEIGHT * queues[i]

        within = {i: footprint(i) for i in eligible if queues[i] <= limit}
        # Footprints within one prompt of the smallest are equal here: a worker whose cache is
        # full (vLLM's always is, once warm) holds its capacity give or take a block, so the
        # difference says nothing about room. Among those, the worker sent fewest requests
        # lately, as the score breaks ties; else sessions piled onto whichever held a block less.
        least = min(within.values())
        return min(
            (i for i, f in within.items() if f <= least + size),
            key=lambda i: (self._shares.count(workers[i].id), workers[i].load, within[i]),
        )

    def forget(self, worker: Hashable) -> None:
        self._removals.pop(worker, None)
