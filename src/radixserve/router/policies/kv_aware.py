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
# new sessions are spread by footprint (eviction_placement.py). Applied then too, it cost 0.7 points of hit rate on
# simulated chat at a tenth of the pool (benchmarks/kv_aware_sweep.py, a seeded 10% dropped) and 0.2
# on the Mooncake trace; off then, chat lost nothing and the trace moved by under 0.1 point (at half
# and a tenth of the pool).
#
# Placement while the fleet evicts, by the smallest footprint: eviction_placement.py.
# Tokens a worker can load from a lower tier rather than compute: prefill_work.py.
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

from radixserve.router.kvindex.block_index import BlockIndex, InMemoryIndex, keys_by_size
from radixserve.router.kvindex.tiers import HostTier, TierSource
from radixserve.router.policies.base import RequestView, RouterPolicy, WorkerView, healthy_indices
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.eviction_placement import EvictionPlacement
from radixserve.router.policies.inflight import INFLIGHT_BLOCK, InFlightBlocks
from radixserve.router.policies.pending import PendingPrefill
from radixserve.router.policies.prefill_work import prefill_work, prompt_size, servable
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
        self._evictions = EvictionPlacement(self.index, self._pending, self._shares)

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
        evicting = [self._evictions.evicting(w, now) for w in ids]  # dates every change it sees
        if len(ids) > 1 and any(evicting):
            placed = self._evictions.place(workers, eligible, cached, size)
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
        self._evictions.forget(worker_id)

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
