"""`--policy cache_aware`: prefix locality within load bounds, from an approximate tree of what
the router sent each worker (sglang-router's policy, improved where noted). Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Sequence

from radixserve.router.policies.base import RequestView, RouterPolicy, WorkerView, healthy_indices
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.shares import DispatchShares
from radixserve.router.policies.tree import NODE_UNITS, MultiTenantTree
from radixserve.router.policies.tree_keys import units
from radixserve.router.policies.warmup import WarmUp

# ----- cache_aware ------------------------------------------------------------------------------
#
# Sends each request to the worker most likely to hold its prefix in KV cache, as long as that
# worker is not overloaded, and places prefixes that nobody holds so that load stays even.
#
# State: a MultiTenantTree (tree.py) of what the router has sent each worker, keyed by the
# request's packed prompt (tree_keys.py) under its namespace (key kind, model, LoRA, cache salt), so
# it never expects a hit that an engine cannot serve. `select` only reads the tree;
# `on_dispatch` inserts the key for the worker an attempt is sent to (every attempt, retries
# included). Lengths and sizes are in units of 8 key bytes.
#
# select(workers, request, now):
#   1. Consider healthy workers only; floor = the smallest load (in-flight requests).
#   2. A worker is overloaded when load - floor > balance_abs_threshold AND
#      load > floor * balance_rel_threshold: sglang-router's imbalance test, applied per worker
#      (the fleet is imbalanced in sglang's sense exactly when some worker is overloaded).
#   3. Hit: among workers that are not overloaded, take the longest prefix match; if
#      matched / key length > cache_threshold, send the request there. Equal matches go to the
#      holder that received the prefix most often (its home), then the most recent, then the
#      least loaded; but if another holder with an equal match has lately (the last ~4,096
#      dispatches, shares.py) been sent share_slack of the mean less, to that one: either
#      serves the prefix from cache, so this move costs no hit. Unless the chosen holder has
#      lately been sent more than share_slack above the mean and at least SPILL_MIN_EXCESS
#      requests more: then this one request spills to the eligible worker sent the least.
#   4. Miss: among workers that are not overloaded and whose load, averaged over about the last
#      second (LOAD_SMOOTHING_SECS), is within two Poisson standard deviations of the mean of
#      those averages (avg <= mean + 2 * sqrt(mean) + 1), take the smallest tree, then the
#      least loaded.
#
# Where this departs from sglang-router, and why:
#   - Under imbalance sglang-router sends every request to the least loaded worker, throwing
#     all locality away at once. Here only the overloaded workers' requests move; prefixes held
#     elsewhere keep hitting. Moved traffic returns home when the worker recovers (home = most
#     hits, not most recent), so a load spike spills a few requests instead of migrating whole
#     prefix groups, which over-corrects and oscillates (simulated: affinity fell to 0.3-0.5).
#     Between holders of an equal match, though, home yields to one sent share_slack less:
#     chat sessions sharing a system prompt all match it equally, and a home took every new
#     session (each sticky for its later turns) until its excess spilled, which left the
#     busiest engine at 1.14x / 1.33x / 1.45x the mean busy time with 4 / 8 / 16 engines
#     (`radixserve sim --workload multi-turn`, 400 sessions x 10 turns, 1 session/s, 20 s
#     think time); with the switch 1.09x / 1.07x / 1.12x at share_slack 0.05, and 1-1.5
#     points more hits; 1.03x / 1.05x / 1.09x at the default 0.03, with the same hits.
#   - sglang-router has no share_slack. Prefix groups never draw exactly equal traffic, so
#     keeping every request of a group home leaves the busiest worker 5-11% above the mean on
#     the 16-group benchmark (the luck of which groups share a worker). Spilling only a
#     holder's excess keeps it within the slack at the cost of that excess, a few percent of
#     its requests, each a cache miss on a worker that then holds the prefix too.
#   - On a miss sglang-router takes the smallest tree whatever its load, so a worker serving one
#     hot prefix (small tree, high load) attracts every new prefix. Least-load-first is no
#     cure: in-flight counts are noisy, and in a 16-group simulation it put 5 groups on one
#     worker and 3 on another (busiest 1.2-1.3x the mean), where smallest-tree-among-calm
#     workers placed 4/4/4/4 in 64 of 64 runs. Tree size (distinct content held) is the better
#     long-run signal; load is the guard. The guard reads a load average, not the instantaneous
#     count: in front of real processes a worker stalled for a few milliseconds (descheduled,
#     a GC pause) gathers most in-flight requests at once, and an instantaneous guard then gave
#     its share of the new prefixes to the others for good (5/4/4/3 in 1 run of 40).
#
# Parameters (CachePolicyConfig; names and defaults follow sglang-router's flags; its newer
# releases default to 0.3 / 64 / 1.5 / 120 s / 2**26 characters instead):
#   cache_threshold (0.5): the matched share of the key above which a request is a hit;
#       at or below it the request counts as new and is placed by step 4.
#   balance_abs_threshold (32), balance_rel_threshold (1.0001): a worker is overloaded only
#       when it exceeds the least loaded by more than abs requests AND more than rel times.
#   eviction_interval_secs (60): tick(now) trims the tree at most this often; 0 disables
#       eviction altogether (the cap below included), so tests are deterministic.
#   max_tree_size (2**20 units, about 8 MiB per worker; sglang: 2**24 characters): per-worker
#       cap on key units plus NODE_UNITS (60) per node held, so that it bounds router memory
#       (about max_tree_size * 8 bytes per worker) for short prompts too. Eviction drops a
#       worker's least recently used leaves until it is within 7/8 of the cap (the headroom
#       amortises the walk over the whole tree). Unlike sglang-router, the cap is also enforced
#       at dispatch: a timer alone lets the tree grow with the request rate (sglang-router:
#       640 MB after 100,000 2,000-character prompts, most of a minute's worth).


LOAD_SMOOTHING_SECS = 1.0
"""Time constant of the load average that the placement guard reads."""
SPILL_MIN_EXCESS = 36
"""Dispatches above the mean below which a holder never spills. Early on, spills would hand
prefixes to workers whose one hit ties the home's few and flips it (simulated: groups split,
affinity 0.77 with a floor of 1.5 standard deviations); 32-40 kept every group >= 95% home and
the busiest worker <= 1.10x the mean in 200 closed-loop runs of the 16-group benchmark."""


class CacheAwarePolicy(RouterPolicy):
    """Prefix locality within load bounds; the algorithm is explained above."""

    name = "cache_aware"
    tree: MultiTenantTree

    def __init__(self, config: CachePolicyConfig | None = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        self.tree = MultiTenantTree(node_units=NODE_UNITS)
        self._last_eviction = -math.inf
        self._matched_units = 0
        self._total_units = 0
        # worker -> (load average, load at the last observation, which held since then)
        self._loads: dict[Hashable, tuple[float, int]] = {}
        self._observed_at = -math.inf
        self._shares = DispatchShares()
        self._warmup = WarmUp(self.config.warmup_secs)

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        healthy = healthy_indices(workers)
        self._observe(workers, healthy, now)
        floor = min(workers[i].load for i in healthy)
        eligible = [i for i in healthy if self._within_balance(workers[i].load, floor)]
        hit = self._best_match(workers, eligible, request)
        if hit is not None:
            return self._spill(workers, eligible, hit)
        return self._place(workers, eligible, now, len(healthy))

    def on_dispatch(self, worker_id: Hashable, request: RequestView, now: float) -> None:
        held = self.tree.insert(request.key, worker_id, now, request.namespace)
        self._matched_units += held
        self.last_hit = held
        total = units(request.key)
        self._total_units += total
        if total and held / total <= self.config.cache_threshold:
            self._warmup.record_new(worker_id)
        self._shares.record(worker_id)
        cfg = self.config
        if cfg.eviction_interval_secs > 0 and self.tree.cost(worker_id) > cfg.max_tree_size:
            self._evict_soon()

    def on_worker_removed(self, worker_id: Hashable) -> None:
        self.tree.remove_tenant(worker_id)
        self._loads.pop(worker_id, None)
        self._shares.forget(worker_id)
        self._warmup.forget(worker_id)

    def tick(self, now: float) -> None:
        interval = self.config.eviction_interval_secs
        if interval > 0 and now - self._last_eviction >= interval:
            self._evict_soon()
            self._last_eviction = now

    def _evict_soon(self) -> None:
        if self.defer_eviction:
            self.evict_due = True
        else:
            self.tree.evict_tenant_by_cost(self.config.tree_evict_target)

    def eviction_slices(self) -> Iterator[int]:
        """The deferred eviction, in slices of bounded work (see MultiTenantTree)."""
        self.evict_due = False
        return self.tree.evict_in_slices(self.config.tree_evict_target)

    def expected_hit_rate(self) -> float:
        """Share of dispatched key units that the chosen worker already held."""
        return self._matched_units / self._total_units if self._total_units else 0.0

    def _within_balance(self, load: int, floor: int) -> bool:
        cfg = self.config
        over_abs = load - floor > cfg.balance_abs_threshold
        return not (over_abs and load > floor * cfg.balance_rel_threshold)

    def _best_match(
        self, workers: Sequence[WorkerView], eligible: list[int], request: RequestView
    ) -> int | None:
        """The eligible worker with the longest match, if its match rate clears the threshold."""
        total = units(request.key)
        matches = self.tree.tenant_matches(request.key, request.namespace) if total else {}
        best, best_rank = None, None
        for i in eligible:
            matched, hits, stamp = matches.get(workers[i].id, (0, 0, 0.0))
            rank = (matched, hits, stamp, -workers[i].load)
            if matched and (best_rank is None or rank > best_rank):
                best, best_rank = i, rank
        if best_rank is None or best_rank[0] / total <= self.config.cache_threshold:
            return None
        tied = [i for i in eligible if matches.get(workers[i].id, (0,))[0] == best_rank[0]]
        return self._among_holders(workers, eligible, tied, best)  # type: ignore[arg-type]

    def _among_holders(
        self, workers: Sequence[WorkerView], eligible: list[int], tied: list[int], home: int
    ) -> int:
        """The home, unless another worker holding as much has lately been sent share_slack
        of the mean less: moving a request between holders costs no hit, so no
        SPILL_MIN_EXCESS floor applies."""
        if len(tied) < 2:
            return home
        count = self._shares.count
        alt = min(tied, key=lambda i: (count(workers[i].id), workers[i].load))
        mean = sum(count(workers[i].id) for i in eligible) / len(eligible)
        gap = count(workers[home].id) - count(workers[alt].id)
        return alt if gap > self.config.share_slack * mean else home

    def _spill(self, workers: Sequence[WorkerView], eligible: list[int], hit: int) -> int:
        """`hit`, unless it has lately been sent too much more than the mean (step 3)."""
        ids = [workers[i].id for i in eligible]
        excess, mean = self._shares.excess(workers[hit].id, ids)
        if excess <= max(self.config.share_slack * mean, SPILL_MIN_EXCESS):
            return hit
        return min(eligible, key=lambda i: self._shares.count(workers[i].id))

    def _observe(self, workers: Sequence[WorkerView], healthy: list[int], now: float) -> None:
        """Fold the time since the last observation into the load averages, at the loads seen
        then; a worker first seen starts at its current load."""
        elapsed, loads = now - self._observed_at, self._loads
        weight = 1.0 - math.exp(-elapsed / LOAD_SMOOTHING_SECS) if elapsed > 0 else 0.0
        for i in healthy:
            wid, load = workers[i].id, workers[i].load
            if wid not in loads:
                self._warmup.join(wid, now)
            avg, held = loads.get(wid, (load, load))
            loads[wid] = (avg + weight * (held - avg), load)
        self._observed_at = max(self._observed_at, now)
        self._shares.observe([workers[i].id for i in healthy])

    def _place(
        self, workers: Sequence[WorkerView], eligible: list[int], now: float, fleet: int
    ) -> int:
        """Where a new prefix goes: the smallest tree among workers not lastingly busier than
        average and not past their warm-up cap, then the least loaded."""
        avg = [self._loads.get(workers[i].id, (workers[i].load, 0))[0] for i in eligible]
        mean = sum(avg) / len(avg)
        # Two standard deviations of a Poisson count: busier than this is not noise.
        ceiling = mean + 2.0 * math.sqrt(mean) + 1.0
        calm = [i for i, a in zip(eligible, avg) if a <= ceiling]
        if self._warmup.active():
            calm = [i for i in calm if self._warmup.allows(workers[i].id, now, fleet)] or calm
        return min(calm, key=lambda i: (self.tree.size(workers[i].id), workers[i].load))
