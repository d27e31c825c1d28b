"""The kv_aware policy: route on what the workers' KV caches really hold (a BlockIndex fed by
their KV events) and on the prefill work each worker already has, both in tokens.
Registered as `--policy kv_aware`; pure (no I/O, no clock)."""

# ----- kv_aware -----------------------------------------------------------------------------
#
# Llumnix's dispatch rule on precise prefix knowledge. For a request of P prompt tokens, each
# healthy worker w that is not overloaded is scored
#
#     score(w) = (P - cached(w)) + PENDING_WEIGHT * pending(w)
#
# cached(w)   the leading prompt tokens w holds: the longest contiguous run of the prompt's
#             blocks in the index (kvindex/block_index.py; block size learned from w's events). A worker the
#             index does not know (it publishes no events, or its stream broke and is being
#             resynchronised) is scored from an approximate tree of what the router sent it,
#             as cache_aware keeps one, so mixed fleets work. Prompts dispatched to w and not
#             yet complete count as held too (InFlightBlocks): their blocks are announced only
#             once computed, yet a request queued behind them hits, and a running request's
#             KV cannot be evicted. Without this a burst sharing a new prefix scattered.
# pending(w)  prefill tokens already sent to w and not yet computed: the uncached tokens of
#             each dispatch, counted at dispatch time. When the worker reports its own waiting
#             prefill tokens (WorkerView.prefill_tokens, stamped reported_at), the report
#             replaces every dispatch made up to that moment; later dispatches add to it. A
#             burst therefore spreads at once instead of piling onto one worker until a poll.
#             The simulator reports exactly; the HTTP router reads each worker's /get_loads
#             (waiting_prefill_tokens) after every health probe. A worker that does not report
#             it has each dispatch counted until the request completes (an overestimate that
#             lasts the request's decode). A request sent before a report and completed after
#             it leaves the report's count until the next one (policies/pending.py).
#
# A small hold is no preference while nothing is evicted. When the most any eligible worker holds of
# the prompt (on device or loadable) is at most cache_threshold of it (0.5, cache_aware's flag: its
# test for a hit), the hold is ignored and the request is placed as a new prefix is: least queued,
# then fewest running, then fewest sent lately. A new chat whose only shared part is a short system
# prompt then goes round an idle fleet instead of to the worker that served the first chat, while a
# repeat of a prompt mostly held still goes to its holder. Without it (issue 26, two vLLM servers of
# 45 blocks, 8 chats sharing a 64-token system prompt, one request at a time) the first 4 chats all
# went to one worker, which then thrashed: vLLM's hit rate was 48.7% under kv_aware against 68.4%
# under cache_aware; with it 68.4% each, 4 chats a worker, each on one worker throughout. Where the
# shared prompt is long (8 chats sharing 215 tokens of instructions, all open, on the same servers)
# cache_aware sends every chat to one worker, since the instructions are most of a new chat's
# characters though under half its tokens; that worker evicts each history before its next turn:
# vLLM's hit rate 40.4% under cache_aware, 73.1% under kv_aware, which spreads them. It gives up
# under half a prompt's prefill per request so placed: where the chats would all have fit on one
# worker, the other computes the shared prompt once more (4 chats of 3 turns on those servers: 64
# hit tokens fewer than cache_aware's 2,624, which kept them on one worker). While the fleet evicts,
# the rule is off: a partial hold (a session's history partly evicted) is then worth chasing, and
# new sessions are spread by the rule below. Applied then too, it cost 0.7 points of hit rate on
# simulated chat at a tenth of the pool (benchmarks/kv_aware_sweep.py, a seeded 10% dropped) and 0.2
# on the Mooncake trace; off then, chat lost nothing and the trace moved by under 0.1 point (at half
# and a tenth of the pool).
#
# Placement while the fleet evicts. A request every eligible worker holds equally and partly
# (a system prompt they all have, nothing more of it anywhere) has no holder to prefer, and the
# score above would send it to the least queued worker. While some eligible worker has removed
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
#
# Lower tiers (issue 28). Tokens a worker can load rather than compute cost their load time in
# prefill tokens, at the load-to-prefill ratio the worker reports for the tier they come from
# (seconds to load a token over seconds to prefill one, the engine's running means of its own
# timings: engine/load_meter.py; WorkerView.kv_load_ratio, kv_store_load_ratio). host(w): the
# leading tokens it holds on device or in its host tier, as its KV events' `medium` announces
# them (HostTier); store(w): those in a KV store every worker reads (Mooncake Store, as its
# master's metadata says; TierSource). A prefix loads from the nearest tier holding it:
#
#     near = max(cached, host),  held = max(near, store)
#     (P - held) + r_host(w) * (near - cached) + r_store(w) * (held - near)
#
# A worker that reports no host ratio is charged DEFAULT_LOAD_RATIO (see there); no store
# ratio, the larger of that and its host ratio (a store load lands in the host tier and is
# copied on from there: it never costs less than a host load). Llumnix counts a
# store hit as a hit (ratio 0); with a ratio the device holder still wins a tie, and a worker
# that can load a prefix cheaply takes it over a busier one that holds it on device. While a
# source cannot answer (its service down) it counts for no worker: the score is the device's.
#
# Both terms are tokens of prefill work. Llumnix adds them as they are (a hit worth exactly the
# prefill it saves); here queued tokens weigh PENDING_WEIGHT (1/4), because a miss also copies
# the prefix into a second pool, where it evicts what later requests would have hit. The
# smallest score wins; ties go to the worker with fewer requests in flight (decode load), then
# to the one sent fewest requests lately (DispatchShares' decayed count), then at random. The
# second tie-break spreads new prefixes that arrive one at a time on an idle fleet (every
# worker at zero load and zero queue): they go round the workers. With a random draw there,
# issue 26 saw 4 new prompts of 4 land on one of two vLLM workers, and the spill below then
# moved their repeats away from it.
#
# Guards (prefill tokens alone do not see decode work, which piles up on the holder of a hot
# prefix; without them one engine of eight took no request at all in a simulated chat run):
#   - Prompts shorter than cache_aware_scheduling_min_tokens (Llumnix's flag) carry no prefix
#     worth chasing: they go to the least loaded worker (requests, then pending prefill, then
#     the fewest sent lately: one at a time on an idle fleet they go round the workers).
#   - A worker overloaded in sglang-router's sense (load - floor > balance_abs_threshold AND
#     load > floor * balance_rel_threshold, in requests), or busier than the mean load by more
#     than Poisson noise (mean + 2 * sqrt(mean) + 1), is skipped.
#   - Spill, as cache_aware's step 3: a pick whose recent dispatches exceed the mean by more
#     than KV_SPILL_SLACK of it and by more than KV_SPILL_MIN_EXCESS yields to the least-sent
#     worker. Its own slack, not cache_aware's share_slack: 5% measured best for kv_aware in
#     the sweep (at cache_aware's 3% kv_aware lost 0.2-1.7 more points of hits on the Mooncake
#     trace).
#   - Spill never moves a request off a pick that holds KEEP_SHARE (95%) or more of what it
#     could ever serve of the prompt, and the two gates above never skip such a worker: there
#     the hit is nearly the whole prefill (the request adds little work), and sending it
#     elsewhere copies the prompt into a second pool as well. What a worker can serve is the
#     prompt's full blocks at its block size before the last token (servable): an engine
#     never caches a partial block and always computes the last token. Measured against the
#     prompt's length the rule never fired at vLLM's block sizes: with 128-token blocks a
#     holder of a 684-token prompt has 640 tokens (93.6%), all it can have (issue 26).
#   - A worker that published events once and is unknown now (its stream broke, it restarted)
#     is expected to hold nothing, not scored from the tree: the tree is what went stale. While
#     the index cannot answer at all (Redis down) every worker is scored from the tree, which
#     on_dispatch keeps up to date all along, so the fallback is as warm as cache_aware.
#   - A request without token ids (the router could not tokenize it) is scored from the
#     approximate tree alone, with its key units standing in for tokens.

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

from radixserve.router.kvindex.block_index import (
    BlockIndex,
    InMemoryIndex,
    keys_by_size,
    leading_held,
)
from radixserve.router.kvindex.tiers import HostTier, TierSource
from radixserve.router.policies.base import RequestView, RouterPolicy, WorkerView, healthy_indices
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.pending import PendingPrefill
from radixserve.router.policies.shares import DispatchShares
from radixserve.router.policies.tree import NODE_UNITS, MultiTenantTree
from radixserve.router.policies.tree_keys import units

KeysFor = Callable[[int], list[int]]  # block size -> the prompt's block keys at that size
KV_SPILL_MIN_EXCESS = 4
"""Recent dispatches above the mean at or below which kv_aware never spills (cache_aware's
SPILL_MIN_EXCESS is 36). Its score already spreads new prefixes by prefill work, so a spill
here only corrects sticky sessions piling up; on 8 engines of multi-turn chat 4 kept the
busiest engine within 1.03x the mean busy time where 36 left it at 1.13x, at no cost in hit
rate."""
KV_SPILL_SLACK = 0.05
PENDING_WEIGHT = 0.25
"""What one queued prefill token weighs against one uncached prompt token. A miss costs more
than its own prefill: the prefix is then copied into a second pool and evicts something there.
Simulated (8 engines, Mooncake trace, half the KV pool): 1 lost 1.8 points of hit rate against
cache_aware, 0.25 lost 0.7 at the same TTFT p99; 0 (affinity alone) raised TTFT p99 by 17%."""
KEEP_SHARE = 0.95
"""A pick holding this share of the prompt or more is never spilled, and a worker holding it
stays eligible over the load gates. On the Mooncake trace the first kept 0.7 points of hit rate
the spill gave away at half the KV pool; the second 0.5 points at the default pool, where 4
decisions of 3,993 had sent prompts of up to 40k tokens away from the worker holding them. Chat
turns never reach it (a new user turn is more than 5% of the prompt)."""
EVICTING_SECS = 2.0
"""How long after a worker's last removal the fleet counts as evicting (see the header)."""
HELD_PENDING_WEIGHT = 0.5
HELD_QUEUE_SPAN = 8
"""Placement by holdings skips workers whose queued prefill exceeds the shortest queue by more
than this many prompts: on chat at a tenth of the pool, without it TTFT p99 rose above
cache_aware's (1.45 s against 1.30 s); spans of 0.5-2 prompts gave back 0.7-2.2 of the 3.3
points it gained there."""
INFLIGHT_BLOCK = 16
"""Block size for in-flight prompts on a worker whose events have not told one yet."""
DEFAULT_LOAD_RATIO = 0.1
"""Load-to-prefill ratio charged for a worker that reports none: issue 27's target for a store
load (<= 0.1x the recompute time of a 2,000-token prefix). Not 0 (Llumnix's "a store hit is a
hit"): then a worker holding the prefix on device and one that must fetch it would tie, and the
fetch is never free; not larger: a guess above the target would send prefixes that are cheap to
load back to recomputation."""


class KvAwarePolicy(RouterPolicy):
    """Least prefill work, from precise KV events; the algorithm is explained above."""

    name = "kv_aware"
    index: BlockIndex
    tree: MultiTenantTree

    def __init__(
        self,
        config: CachePolicyConfig | None = None,
        seed: int = 0,
        index: BlockIndex | None = None,
        lower: Sequence[TierSource] = (),
    ) -> None:
        super().__init__(config, seed)
        self.index = index if index is not None else InMemoryIndex()
        # what workers can load, not compute: their own host tiers (the index's lower media,
        # from KV events), then KV stores every worker reads
        self.lower = (HostTier(self.index), *lower)
        self.loaded_tokens = 0  # dispatched prompt tokens the pick was expected to load
        self.tree = MultiTenantTree(node_units=NODE_UNITS)  # the fallback's approximate view
        self._pending = PendingPrefill()  # prefill sent to each worker, and its reports
        # the last request select() looked up: what each worker holds of it, its block keys
        self._matches: tuple[RequestView | None, dict[Hashable, int]] = (None, {})
        self._loadable: tuple[RequestView | None, dict[Hashable, int]] = (None, {})
        self._keys: tuple[RequestView | None, KeysFor] = (None, keys_by_size(()))
        self._shares = DispatchShares()
        self._published: set[Hashable] = set()  # workers the index has ever known
        self._flight = InFlightBlocks()
        self._removals: dict[Hashable, tuple[int, float]] = {}  # worker -> (count, seen at)

    # -- the decision ---------------------------------------------------------------------------
    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        healthy = healthy_indices(workers)
        eligible = self._eligible(workers)
        for i in healthy:
            self._pending.reconcile(workers[i])
        size = prompt_size(request)
        if size < self.config.cache_aware_scheduling_min_tokens:
            self._shares.observe([workers[i].id for i in eligible])
            return min(eligible, key=lambda i: self._least_loaded(workers[i]))
        cached = self._cached(workers, healthy, request, size)
        self._matches = (request, cached)
        host, store = self.tier_tokens(workers, healthy, request, size)
        loadable = {w: max(host.get(w, 0), store.get(w, 0)) for w in host.keys() | store.keys()}
        self._loadable = (request, loadable)
        # Workers holding KEEP_SHARE of the prompt stay eligible over the load gates and are
        # never spilled from: the request adds the last few percent of its prefill there, the
        # whole prompt elsewhere.
        keeps = {i for i in healthy if self._keeps(workers[i].id, cached, size)}
        gated = set(eligible)
        eligible = [i for i in healthy if i in gated or i in keeps]
        self._shares.observe([workers[i].id for i in eligible])
        ids = [workers[i].id for i in eligible]
        evicting = [self._evicting(w, now) for w in ids]  # dates every change it sees
        if len(ids) > 1 and any(evicting):
            placed = self._place_while_evicting(workers, eligible, cached, size)
            if placed is not None:
                return placed
            small = False  # a small hold counts while the fleet evicts (see the header)
        else:
            small = self._small_hold(workers, eligible, cached, loadable, size)

        def score(i: int) -> tuple[float, int, float, float]:
            w = workers[i]
            if small:  # no holder to prefer: placed as a new prefix is
                work = float(size)
            else:
                held, near, far = (t.get(w.id, 0) for t in (cached, host, store))
                work = prefill_work(size, held, near, w.kv_load_ratio, far, w.kv_store_load_ratio)
            recent = self._shares.count(w.id)
            return (work + PENDING_WEIGHT * self.pending(w), w.load, recent, self.rng.random())

        return self._spill(workers, eligible, min(eligible, key=score), keeps)

    def _least_loaded(self, w: WorkerView) -> tuple[int, int, float]:
        """Short prompts' order: requests in flight, queued prefill, then requests sent lately
        (so that short prompts arriving one at a time on an idle fleet go round the workers
        rather than all to the first one, as new prefixes do)."""
        return w.load, self.pending(w), self._shares.count(w.id)

    def _block_size(self, worker: Hashable) -> int:
        """The block size `worker` caches in: its events', its in-flight prompts', or the
        default."""
        return self.index.block_size(worker) or self._flight.block_size(worker) or INFLIGHT_BLOCK

    def _keeps(self, worker: Hashable, cached: dict[Hashable, int], size: int) -> bool:
        """Whether `worker` holds KEEP_SHARE of what it could ever serve of the prompt."""
        held = cached.get(worker, 0)
        return held > 0 and held >= KEEP_SHARE * servable(size, self._block_size(worker))

    def _spill(
        self, workers: Sequence[WorkerView], eligible: list[int], pick: int, keeps: set[int]
    ) -> int:
        """`pick`, unless it was lately sent more than its share (cache_aware's step 3) and is
        not among `keeps` (the workers holding KEEP_SHARE of the prompt)."""
        if pick in keeps:
            return pick
        ids = [workers[i].id for i in eligible]
        excess, mean = self._shares.excess(workers[pick].id, ids)
        if excess <= max(KV_SPILL_SLACK * mean, KV_SPILL_MIN_EXCESS):
            return pick
        return min(eligible, key=lambda i: self._shares.count(workers[i].id))

    def _small_hold(
        self,
        workers: Sequence[WorkerView],
        eligible: list[int],
        cached: dict[Hashable, int],
        loadable: dict[Hashable, int],
        size: int,
    ) -> bool:
        """Whether the most any eligible worker holds (on device or loadable) of the prompt is
        at most cache_threshold of it, and something is held: no holder worth preferring (see
        the header)."""
        best = max(
            (max(cached.get(workers[i].id, 0), loadable.get(workers[i].id, 0)) for i in eligible),
            default=0,
        )
        return 0 < best <= self.config.cache_threshold * size

    def _place_while_evicting(
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
        queues = {i: self.pending(workers[i]) for i in eligible}
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

    def _evicting(self, worker: Hashable, now: float) -> bool:
        """Whether `worker` removed blocks within EVICTING_SECS of `now`."""
        count = self.index.removed_blocks(worker)
        seen = self._removals.get(worker)
        if seen is None or seen[0] != count:
            seen = self._removals[worker] = (count, now if count or seen else -math.inf)
        return now - seen[1] < EVICTING_SECS

    def pending(self, worker: WorkerView) -> int:
        """Prefill tokens `worker` has yet to compute, as far as the router knows."""
        return self._pending.tokens(worker)

    def cached_tokens(
        self, workers: Sequence[WorkerView], request: RequestView
    ) -> dict[Hashable, int]:
        """Leading prompt tokens each worker holds (index, or the approximate tree)."""
        return self._cached(workers, range(len(workers)), request, prompt_size(request))

    # -- hooks ----------------------------------------------------------------------------------
    def on_dispatch(self, worker_id: Hashable, request: RequestView, now: float) -> None:
        seen, cached = self._matches
        size = prompt_size(request)
        if seen is not request:  # dispatched without select (a retry's fallback): look again
            cached = self._cached([WorkerView(worker_id)], [0], request, size)
        hit = min(cached.get(worker_id, 0), size)
        seen, loadable = self._loadable
        loaded = max(0, min(loadable.get(worker_id, 0), size) - hit) if seen is request else 0
        self._pending.add(worker_id, id(request), now, size - hit - loaded)
        self.loaded_tokens += loaded
        if request.token_ids is not None:
            bs = self.index.block_size(worker_id) or INFLIGHT_BLOCK
            self._flight.add(worker_id, id(request), bs, self._keys_for(request)(bs))
        self._shares.record(worker_id)
        self.matched_tokens += hit
        self.prompt_tokens += size
        self.last_hit = hit
        if request.key:
            self.tree.insert(request.key, worker_id, now, request.namespace)
            cfg = self.config
            if cfg.eviction_interval_secs > 0 and self.tree.cost(worker_id) > cfg.max_tree_size:
                self.tree.evict_tenant_by_cost(cfg.tree_evict_target)

    def on_complete(self, worker_id: Hashable, request: RequestView, now: float) -> None:
        self._pending.complete(worker_id, id(request), now)
        self._flight.remove(worker_id, id(request))

    def on_worker_removed(self, worker_id: Hashable) -> None:
        self.index.drop_worker(worker_id)
        self.tree.remove_tenant(worker_id)
        self._pending.forget(worker_id)
        self._flight.forget(worker_id)
        self._shares.forget(worker_id)
        self._removals.pop(worker_id, None)

    def loadable_tokens(
        self, workers: Sequence[WorkerView], among: Sequence[int], request: RequestView, size: int
    ) -> dict[Hashable, int]:
        """Leading prompt tokens each worker can load from a lower tier, at most the prompt."""
        host, store = self.tier_tokens(workers, among, request, size)
        return {w: max(host.get(w, 0), store.get(w, 0)) for w in host.keys() | store.keys()}

    def tier_tokens(
        self, workers: Sequence[WorkerView], among: Sequence[int], request: RequestView, size: int
    ) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
        """Leading prompt tokens each worker can load from its host tier and from a KV store
        (the most any source of the tier says; sources that cannot answer say nothing)."""
        ids = [workers[i].id for i in among]
        host: dict[Hashable, int] = {}
        store: dict[Hashable, int] = {}
        if not self.lower or not request.token_ids:
            return host, store
        keys_for = self._keys_for(request)
        for source in self.lower:
            out = host if source.tier == "host" else store
            for w, n in (source.loadable_tokens(ids, keys_for) or {}).items():
                out[w] = min(max(out.get(w, 0), n), size)
        return host, store

    def expected_hit_rate(self) -> float:
        """Share of dispatched prompt tokens the chosen worker held."""
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # -- helpers --------------------------------------------------------------------------------
    def _eligible(self, workers: Sequence[WorkerView]) -> list[int]:
        """Healthy workers that are neither overloaded (sglang-router's test against the least
        loaded) nor busier than the mean by more than Poisson noise (see the header)."""
        cfg, healthy = self.config, healthy_indices(workers)
        loads = [workers[i].load for i in healthy]
        floor, mean = min(loads), sum(loads) / len(loads)
        ceiling = mean + 2.0 * math.sqrt(mean) + 1.0
        return [
            i
            for i, load in zip(healthy, loads)
            if load <= ceiling
            and not (
                load - floor > cfg.balance_abs_threshold
                and load > floor * cfg.balance_rel_threshold
            )
        ]

    def _cached(
        self,
        workers: Sequence[WorkerView],
        among: Sequence[int],
        request: RequestView,
        size: int,
    ) -> dict[Hashable, int]:
        ids = [workers[i].id for i in among]
        out: dict[Hashable, int] = {}
        tokens = request.token_ids
        keys_for = self._keys_for(request)
        if tokens is not None and len(tokens):
            out = self.index.prefix_tokens(ids, keys_for)
        self._published.update(out)
        # A worker that published before and is unknown now lost its stream (a gap, a
        # restart): what the router once sent it says nothing about what it holds. While the
        # index as a whole cannot answer (Redis down) the tree speaks for every worker.
        down = not self.index.answering()
        unknown = [w for w in ids if w not in out and (down or w not in self._published)]
        total = units(request.key)
        if unknown and total:
            matches = self.tree.tenant_matches(request.key, request.namespace)
            for w in unknown:
                out[w] = matches.get(w, (0, 0, 0.0))[0] * size // total
        if tokens is not None and len(tokens):
            for w in ids:
                bs = self._flight.block_size(w)
                if bs:
                    out[w] = max(out.get(w, 0), self._flight.leading_held(w, keys_for(bs)) * bs)
        return out

    def _keys_for(self, request: RequestView) -> KeysFor:
        """The request's block keys at any block size, hashed once per size for the lookup
        and the dispatch hook together."""
        seen, keys_for = self._keys
        if seen is not request:
            keys_for = keys_by_size(request.token_ids or (), request.kv_namespace)
            self._keys = (request, keys_for)
        return keys_for


class InFlightBlocks:
    """Per worker, the block keys of prompts dispatched to it and not yet complete: held (or
    about to be) whatever the index says, since a running request's KV cannot be evicted."""

    def __init__(self) -> None:
        self._counts: dict[Hashable, dict[int, int]] = {}
        self._sizes: dict[Hashable, int] = {}
        self._requests: dict[Hashable, dict[int, list[int]]] = {}

    def add(self, worker: Hashable, request: int, block_size: int, keys: list[int]) -> None:
        if self._sizes.setdefault(worker, block_size) != block_size:
            return  # the worker's block size changed under in-flight prompts: skip this one
        self._requests.setdefault(worker, {})[request] = keys
        counts = self._counts.setdefault(worker, {})
        for k in keys:
            counts[k] = counts.get(k, 0) + 1

    def remove(self, worker: Hashable, request: int) -> None:
        keys = self._requests.get(worker, {}).pop(request, None)
        if keys is None:
            return
        counts = self._counts[worker]
        for k in keys:
            if counts[k] == 1:
                del counts[k]
            else:
                counts[k] -= 1
        if not self._requests[worker]:
            self.forget(worker)

    def forget(self, worker: Hashable) -> None:
        for table in (self._counts, self._sizes, self._requests):
            table.pop(worker, None)

    def block_size(self, worker: Hashable) -> int | None:
        return self._sizes.get(worker)

    def leading_held(self, worker: Hashable, keys: Sequence[int]) -> int:
        """Leading keys of `keys` some in-flight prompt on `worker` shares."""
        return leading_held(keys, self._counts.get(worker, {}))


def prefill_work(
    size: int,
    cached: int,
    loadable: int,
    ratio: float | None,
    store: int = 0,
    store_ratio: float | None = None,
) -> float:
    """A worker's prefill work for a prompt of ``size`` tokens, in tokens: what it must compute,
    plus what it loads from its host tier (``loadable``: leading tokens on device or there)
    weighed by ``ratio`` (None: DEFAULT_LOAD_RATIO) and what only a store holds (``store``)
    weighed by ``store_ratio`` (None: the larger of the default and the host's); device-cached
    tokens cost nothing."""
    cached = min(cached, size)
    near = min(max(cached, loadable), size)
    held = min(max(near, store), size)
    host_ratio = DEFAULT_LOAD_RATIO if ratio is None else ratio
    far_ratio = max(DEFAULT_LOAD_RATIO, host_ratio) if store_ratio is None else store_ratio
    return size - held + host_ratio * (near - cached) + far_ratio * (held - near)


def servable(size: int, block_size: int) -> int:
    """The most of a prompt of ``size`` tokens a worker caching whole blocks of ``block_size``
    can serve from cache: its full blocks before the last token, which the engine always
    computes (vLLM caps a hit at size - 1 tokens, block-aligned; so does our scheduler)."""
    return max(0, (size - 1) // block_size * block_size)


def prompt_size(request: RequestView) -> int:
    """Prompt length in tokens (key units when the router has no token ids)."""
    return len(request.token_ids) if request.token_ids is not None else units(request.key)
