"""Discrete-event simulation of a cluster: N engines (the real Scheduler and RadixCache, run by
SimRunner) behind one router policy, on a virtual clock. Owns the event loop and its report."""

# Events live on one heap ordered by (time, kind, seq): at equal times arrivals come first, then
# step completions, then wake-ups of idle engines, so that requests arriving together are
# batched together. An engine steps as soon as it has work: step() -> SimRunner.run() gives the
# batch and its duration; the batch's on_output() runs when the virtual clock reaches its end.
# With ``decode_runs``, an engine whose next steps are pure decodes (nothing waiting, KV free)
# books the whole run, up to the step that finishes a request, as one event; a request
# dispatched to it meanwhile cuts the run after the step in flight, so the result is exactly
# that of stepping one by one.
# The router sees what a real proxy sees: each worker's in-flight requests and prompt tokens,
# and the prompt's token ids (its own approximate tree for cache_aware).
# Lower tiers (sim/tiers.py): with --enable-hierarchical-cache each engine's scheduler keeps its
# real host tier; with --kv-store-gb a fleet-wide store holds every engine's blocks, and a
# request whose prompt the store holds beyond its engine's device and host match waits for
# that load (a _LAND event) before joining the engine's queue; at admission the store is looked
# up again (a prefix evicted from device and host while its request waited is loaded before the
# step that admits it, the step waiting for it). kv_aware reads the store's holdings as a lower
# tier (its tier-aware score) and each engine's load-to-prefill ratio.

from __future__ import annotations

import gc
import heapq
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from tqdm import tqdm

from radixserve.cache.tokens import token_array
from radixserve.config import CacheConfig, SchedulerConfig, check_fields
from radixserve.router.kvindex.tiers import FixedTier
from radixserve.router.policies.base import RequestView, RouterPolicy
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.kv_aware import KvAwarePolicy
from radixserve.router.policies.registry import create_policy, policy_names
from radixserve.sched.request import Req, SamplingParams
from radixserve.sched.scheduler import Scheduler
from radixserve.sched.validate import check_request
from radixserve.sim.costmodel import CostModel, get_cost_model
from radixserve.sim.engine_state import _ARRIVE, _DONE, _LAND, _WAKE, _Engine
from radixserve.sim.engine_steps import EngineSteps
from radixserve.sim.kv_feed import KvFeed
from radixserve.sim.report import SimResult
from radixserve.sim.runner import SimRunner
from radixserve.sim.slo import TokenGaps
from radixserve.sim.store_tier import StoreTier
from radixserve.sim.tiers import Landing, SimStore, SimTierConfig
from radixserve.sim.workloads import Chains, WorkloadRequest

PROGRESS_MIN_REQUESTS = 5000  # a progress bar only for runs this long (when asked for one)


def _f(default: object, help: str, **kw: object) -> object:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The simulated fleet: how many engines, on which GPU and model, behind which router."""

    engines: int = _f(8, "engines (workers) behind the router", ge=1)
    router: str = _f(
        "cache_aware", "router policy (as `radixserve route --policy`)", choices=policy_names()
    )
    preset: str = _f("llama3-8b-h100", "cost model of every engine: GPU and model")
    max_concurrency: int | None = _f(
        None, "most requests in flight; later ones wait client-side (None: open loop)", ge=1
    )
    sim_seed: int = _f(0, "seed of the router policy and of the simulated runners")
    cache_policy: CachePolicyConfig = field(
        default_factory=CachePolicyConfig,
        metadata={"help": "the router policy's settings, as `radixserve route`'s"},
    )
    decode_runs: bool = _f(
        True, "advance runs of pure decode steps in one event (same results, faster)"
    )
    tiers: SimTierConfig = field(
        default_factory=SimTierConfig,
        metadata={"help": "the lower KV tiers: host copy bandwidth, the fleet-wide KV store"},
    )

    def __post_init__(self) -> None:
        check_fields(self)
        get_cost_model(self.preset)  # unknown presets fail here, listing the known ones


def default_cache_config(config: ClusterConfig) -> CacheConfig:
    """A KV pool as large as the preset's GPU holds beside the weights."""
    return CacheConfig(max_total_tokens=get_cost_model(config.preset).kv_capacity_tokens)


def host_tier_tokens(cost: CostModel, cache: CacheConfig) -> int:
    """Each engine's host tier in tokens (0: none): --hicache-size or --hicache-ratio as the
    engine reads them, else the preset's host memory per GPU (at least twice the device pool,
    SGLang's default ratio)."""
    if not cache.enable_hierarchical_cache:
        return 0
    per_token = cost.kv_bytes_per_token_per_gpu
    if cache.hicache_size or cache.hicache_ratio is not None:
        return cache.host_tokens(int(per_token))
    n = max(int(cost.tier_spec().host_memory_bytes // per_token), 2 * cache.max_total_tokens)
    return n - n % cache.page_size


class ClusterSim(EngineSteps, StoreTier):
    """Runs a workload once through a fresh fleet; see ``simulate`` for the one-call form."""

    def __init__(
        self,
        config: ClusterConfig,
        sched_config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
    ) -> None:
        self.config = config
        self.sched_config = (sched_config or SchedulerConfig()).for_device("cuda")  # GPU presets
        self.cache_config = cache_config or default_cache_config(config)
        self.now = 0.0
        cost = self.cost = get_cost_model(config.preset)
        tiers = config.tiers
        self.tier_spec = tiers.spec(cost)
        self.host_tokens = host_tier_tokens(cost, self.cache_config)
        store_tokens = tiers.store_tokens(cost)
        self.store = SimStore(store_tokens, tiers.store_block_tokens) if store_tokens else None
        if self.store is not None and tiers.store_block_tokens % self.cache_config.page_size:
            raise ValueError(
                f"store_block_tokens {tiers.store_block_tokens} must be a multiple of the page "
                f"size {self.cache_config.page_size}"
            )
        ratio = cost.load_to_prefill_ratio(self.tier_spec) if self.store is not None else None
        host_ratio = cost.host_load_to_prefill_ratio(self.tier_spec) if self.host_tokens else None
        host_s = cost.kv_bytes_per_token_per_gpu / self.tier_spec.host_bandwidth
        self.engines = [
            _Engine(
                i,
                Scheduler(
                    self.sched_config,
                    self.cache_config,
                    clock=self._clock,
                    host_tokens=self.host_tokens,
                ),
                SimRunner(cost, seed=config.sim_seed, host_load_s_per_token=host_s),
                ratio,
                host_ratio,
            )
            for i in range(config.engines)
        ]
        self._views = [e.view() for e in self.engines]  # kept current as loads change
        self._store_source = FixedTier({}, "store")  # the store's answer for the request routed
        self.policy = self._make_policy()
        index = self.policy.index  # kv_aware: fed by the routed engines' caches
        caches = [e.sched.cache for e in self._routed()]
        self._feed = None if index is None else KvFeed(caches, index)
        self.tbt = TokenGaps()  # the time between each request's tokens
        self._events: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._live: dict[str, tuple[Req, _Engine, RequestView]] = {}
        self._sampling: dict[int, SamplingParams] = {}
        self._ran = False
        self._stale: set[int] = set()  # DONE events of cut decode runs
        self._store_rids: set[str] = set()  # live requests the store looked up (it writes them)
        self._landings: dict[str, Landing] = {}  # requests that loaded from the store or host
        self._loading: dict[int, tuple[str, int]] = {}  # _LAND payload -> (rid, store tokens)
        # how the fast path was used (evicting: steps inside runs that evicted)
        self.run_counts = {"runs": 0, "steps": 0, "cuts": 0, "evicting": 0}
        self._evicting: dict[int, float] = {}  # engine in a run -> when its next eviction is
        self.refetched = 0  # store loads made at admission (prefix evicted while it waited)

    def _clock(self) -> float:
        return self.now

    def _routed(self) -> list[_Engine]:
        """The engines the router policy picks from (worker i: the i-th)."""
        return self.engines

    def _make_policy(self) -> RouterPolicy:
        cfg = self.config
        if self.store is not None and cfg.tiers.tier_aware and cfg.router == KvAwarePolicy.name:
            return KvAwarePolicy(cfg.cache_policy, cfg.sim_seed, lower=(self._store_source,))
        return create_policy(cfg.router, cfg.cache_policy, cfg.sim_seed)

    def _push(self, t: float, kind: int, payload: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload))

    # -- the loop ----------------------------------------------------------------------------
    def run(
        self,
        requests: Sequence[WorkloadRequest],
        label: str = "",
        progress: bool = False,
        block_tokens: int | None = None,
    ) -> SimResult:
        """Serve every request; returns the report once the last one has finished. With
        ``block_tokens`` (trace replay), cached blocks of requests with hash ids are counted."""
        if self._ran:
            raise RuntimeError("a ClusterSim runs once: its engines keep their caches")
        self._ran, self._draining = True, False
        wall = time.perf_counter()
        with _fewer_gc_passes():
            self._prepare(requests, label, block_tokens)
            show = progress and len(self._reqs) >= PROGRESS_MIN_REQUESTS
            desc = label or "sim"
            with tqdm(total=len(self._reqs), desc=desc, unit="req", disable=not show) as bar:
                self._bar = bar
                self._loop()
        res = self._result
        res.engines = [e.load for e in self.engines]
        res.tbt_hist = self.tbt.hist
        self.run_counts["evicting"] = sum(e.sched.run_evictions for e in self.engines)
        res.wall_s = time.perf_counter() - wall
        res.num_unfinished = len(self._live) + len(self._backlog)
        res.router, res.schedule_policy = self.config.router, self.sched_config.schedule_policy
        res.tiers = self.tier_report()
        return res

    def tier_report(self) -> dict[str, object]:
        """The lower tiers' sizes and what moved through them (empty: no tier)."""
        if not self.host_tokens and self.store is None:
            return {}
        out: dict[str, object] = {
            "host_tokens_per_engine": self.host_tokens,
            "host_loaded_tokens": sum(e.runner.host_loaded for e in self.engines),
        }
        if self.host_tokens:
            out["host_load_to_prefill_ratio"] = self.engines[0].host_ratio
        if self.store is not None:
            st = self.store
            out.update(
                store_tokens=st.capacity * st.block,
                store_blocks_held=len(st),
                store_blocks_written=st.written,
                store_blocks_read=st.read,
                store_blocks_evicted=st.evicted,
                store_loads_at_admission=self.refetched,
                load_to_prefill_ratio=self.engines[0].ratio,
                tier_aware_router=isinstance(self.policy, KvAwarePolicy)
                and bool(self.policy.lower),
            )
        return out

    def _prepare(
        self, requests: Sequence[WorkloadRequest], label: str, block_tokens: int | None
    ) -> None:
        self._block_tokens = block_tokens
        self._reqs = list(requests)
        self._index = {r.rid: i for i, r in enumerate(self._reqs)}
        self._chains = Chains(self._reqs)
        self._backlog: deque[int] = deque()
        self._outstanding = 0
        self._result = SimResult.empty(label, len(self._reqs), self.config.engines)
        for i in self._chains.roots:
            self._push(self._reqs[i].arrival_s, _ARRIVE, i)

    def _loop(self) -> None:
        events, engines = self._events, self.engines
        while events:
            t, kind, seq, payload = heapq.heappop(events)
            self.now = t
            if kind == _ARRIVE:
                self._arrive(payload)
            elif kind == _DONE:
                if seq not in self._stale:
                    self._complete(engines[payload], seq)
                else:
                    self._stale.discard(seq)
            elif kind == _WAKE:
                self._step(engines[payload])
            else:
                self._land(payload)

    def _arrive(self, i: int) -> None:
        limit = self.config.max_concurrency
        if limit is not None and self._outstanding >= limit:
            self._backlog.append(i)
            return
        self._outstanding += 1
        self._dispatch(i)

    def _dispatch(self, i: int) -> None:
        if self._evicting and self._feed is not None:  # kv_aware reads every engine's tree
            self._begin_steps()
        w, now = self._reqs[i], self.now
        # the prompt as an array once: the router's key, the request and the store lookup take
        # it as it is (each converted a list of its own: a fiftieth of a run's time)
        ids = token_array(w.input_ids)
        view = RequestView.from_prompt(input_ids=ids)
        self.policy.tick(now)
        held = self._store_lookup(w.rid, ids) if self.store is not None else 0
        if self._feed is not None:
            self._feed.flush()
            self._views = [e.reported_view(now) for e in self.engines]
        pick = self.policy.select(self._views, view, now)
        eng = self.engines[pick]
        if eng.idx in self._evicting:
            self._begin_steps_of(eng)
        self.policy.on_dispatch(eng.idx, view, now)
        req = Req(w.rid, ids, self._params(w.output_len), arrival_time=now)
        wait = self._plan_load(eng, req, held) if held else None
        try:
            if wait is None:
                eng.sched.add_request(req)
            else:  # checked now, queued once its prefix has landed
                check_request(req, eng.sched.context_length, eng.sched.kv.total, eng.sched.kv.page)
        except ValueError as e:
            self._result.reject(w.rid, str(e))
            self.policy.on_complete(eng.idx, view, now)
            self._store_rids.discard(w.rid)
            self._finished_one(w.rid)
            return
        if wait is not None:
            self._seq += 1
            self._loading[self._seq] = (w.rid, held)
            heapq.heappush(self._events, (wait, _LAND, self._seq, self._seq))
        n = len(w.input_ids)
        eng.load.requests += 1
        eng.load.prompt_tokens += n
        eng.requests += 1
        eng.tokens += n
        self._views[eng.idx] = eng.view()
        self._live[w.rid] = (req, eng, view)
        if wait is None:
            self._wake(eng)

    def _wake(self, eng: _Engine) -> None:
        """A request joined ``eng``'s queue: cut its decode run, step it if idle."""
        if eng.run is not None:
            self._cut(eng, eng.run)
        if not eng.awake:
            eng.awake = True
            self._push(self.now, _WAKE, eng.idx)

    def _params(self, output_len: int) -> SamplingParams:
        sp = self._sampling.get(output_len)
        if sp is None:
            sp = self._sampling[output_len] = SamplingParams(
                max_new_tokens=output_len, ignore_eos=True
            )
        return sp

    def _finish(self, rid: str) -> None:
        req, eng, view = self._live.pop(rid)
        if self.store is not None:
            self._write_store(rid, req.input_ids, req.output_ids)
            self._store_rids.discard(rid)
        self._result.record(req)
        self._result.record_tbt(self.tbt.pop(rid))
        self._result.record_tiers(req, self._landings.pop(rid, None))
        w = self._reqs[self._index[rid]]
        if self._block_tokens and w.hash_ids:
            self._result.record_blocks(req, len(w.hash_ids), self._block_tokens)
        eng.load.cached_tokens += req.cached_tokens
        eng.requests -= 1
        eng.tokens -= len(req.input_ids)
        self._views[eng.idx] = eng.view()
        self.policy.on_complete(eng.idx, view, self.now)
        self._finished_one(rid)

    def _finished_one(self, rid: str) -> None:
        """Free the client's slot and release what waited on this request."""
        self._outstanding -= 1
        for j, think in self._chains.after(self._index[rid]):
            self._push(self.now + think, _ARRIVE, j)
        if not self._draining:  # a rejected request refills from inside this loop: no recursion
            self._draining = True
            limit = self.config.max_concurrency or math.inf
            while self._backlog and self._outstanding < limit:
                self._outstanding += 1
                self._dispatch(self._backlog.popleft())
            self._draining = False

    def check_integrity(self) -> None:
        """Recount every engine's KV accounting and the router's tree."""
        for eng in self.engines:
            eng.sched.check_integrity()
        if self.policy.tree is not None:
            self.policy.tree.check_integrity()
        if self._feed is not None:
            for tracker in self._feed.trackers:
                tracker.check()
            self._feed.index.check_integrity()
        if self.store is not None:
            self.store.check()


@contextmanager
def _fewer_gc_passes(young: int = 10_000) -> Iterator[None]:
    """Collect the youngest generation every ``young`` allocations instead of CPython's 700.
    A run allocates millions of short-lived lists and entries but few reference cycles, and the
    default made the collector a third of a shared-prefix run's time; cycles are still freed."""
    old = gc.get_threshold()
    if old[0]:  # 0: automatic collection is off, leave it so
        gc.set_threshold(max(young, old[0]), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def simulate(
    requests: Sequence[WorkloadRequest],
    config: ClusterConfig | None = None,
    sched_config: SchedulerConfig | None = None,
    cache_config: CacheConfig | None = None,
    label: str = "",
    progress: bool = False,
    best_hit_rate: float | None = None,
    block_tokens: int | None = None,
) -> SimResult:
    """Run ``requests`` through a fresh simulated fleet and report (see ``ClusterSim.run``)."""
    sim = ClusterSim(config or ClusterConfig(), sched_config, cache_config)
    res = sim.run(requests, label, progress, block_tokens)
    res.best_hit_rate = best_hit_rate
    return res
