"""Prefill and decode apart in the discrete-event simulator: an xPyD fleet of the same engines
(the real Scheduler, RadixCache and router policies), the prompt's KV sent between them."""

# A request's life in an xPyD fleet (DESIGN.md, "Prefill and decode apart"):
#   dispatch  the router's policy (--router: cache_aware, kv_aware, ...) picks the prefill
#             engine, where the prefix lives; --decode-router (a load policy) picks the decode
#             engine. Both get the request at once.
#   prefill   the prefill engine admits it with its radix cache and scheduler as any request
#             of one new token: a cached prefix is not recomputed; the prompt's KV stays
#             pinned in its tree until it has been sent.
#   reserve   once prefilled, the decode engine takes it (in the order prefills end) as soon
#             as its pool holds the prompt and everything every request there may still
#             decode (sched/receive.py): a decode engine never retracts, so it never runs a
#             prefill token. Reserving only then keeps the two pools from waiting on each
#             other: slots held on a decode engine for prompts not yet computed, while the
#             prefill engine's pool is full of prompts waiting for decode slots, is a deadlock.
#   transfer  then: the whole prompt's KV, bytes / the preset's network
#             bandwidth (--transfer-bandwidth-gbs), one transfer at a time on the prefill
#             engine's link and on the decode engine's (later ones queue behind).
#   decode    the KV and the first token land: that is the request's first token for its
#             client (TTFT); the decode engine decodes it from its next step to the end, and
#             keeps the sequence in its tree when it finishes.
# Engines 0..X-1 prefill, X..X+Y-1 decode; the policies number their own workers from 0.

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.cache.radix import TreeNode
from radixserve.config import CacheConfig, SchedulerConfig, check_fields
from radixserve.router.policies.base import RequestView, WorkerView
from radixserve.router.policies.registry import create_policy, policy_names
from radixserve.sched.request import Req
from radixserve.sched.validate import check_request
from radixserve.sim.cluster import _LAND, ClusterConfig, ClusterSim, _Engine
from radixserve.sim.report import SimResult
from radixserve.sim.workloads import WorkloadRequest


def _f(default: object, help: str, **kw: object) -> object:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class PDConfig:
    """How the prefill/decode split is run (the split itself: ``--pd X:Y``)."""

    decode_router: str = _f(
        "least_load", "policy that picks the decode engine (--pd runs)", choices=policy_names()
    )
    transfer_bandwidth_gbs: float | None = _f(
        None, "prefill -> decode KV bandwidth per GPU, GB/s (default: the preset's)", gt=0
    )

    def __post_init__(self) -> None:
        check_fields(self)


def parse_split(text: str) -> tuple[int, int] | None:
    """``X:Y`` (X prefill and Y decode engines, each >= 1); ``none``: aggregated."""
    if text.lower() in ("none", "agg"):
        return None
    x, sep, y = text.partition(":")
    if not sep or not x.isdigit() or not y.isdigit() or int(x) < 1 or int(y) < 1:
        raise ValueError(f"takes X:Y (prefill and decode engines, each >= 1) or none, got {text!r}")
    return int(x), int(y)


@dataclass(slots=True)
class _Handoff:
    """One request between its prefill engine and its decode engine."""

    prefill: _Engine
    decode: _Engine
    dreq: Req  # the decode engine's request: the whole generation
    first: int = 0  # the token the prefill engine sampled
    pinned: TreeNode | None = None  # the prompt's KV on the prefill engine, until sent


class PDClusterSim(ClusterSim):
    """Runs a workload once through a fresh xPyD fleet; ``simulate_pd`` is the one-call form."""

    def __init__(
        self,
        config: ClusterConfig,
        split: tuple[int, int],
        pd: PDConfig | None = None,
        sched_config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
    ) -> None:
        x, y = split
        if x + y != config.engines:
            raise ValueError(f"--pd {x}:{y} has {x + y} engines but the fleet has "
                             f"{config.engines} (--engines): a comparison keeps its size")  # fmt: skip
        self.num_prefill, self.pd = x, pd or PDConfig()
        super().__init__(config, sched_config, cache_config)
        if self.store is not None or self.host_tokens:
            raise ValueError(
                "--pd runs without lower KV tiers (--kv-store-gb, --enable-hierarchical-cache)"
            )
        self.prefill, self.decode = self.engines[:x], self.engines[x:]
        self._views = [e.view() for e in self.prefill]
        self._dviews = [WorkerView(j) for j in range(y)]
        self.decode_policy = create_policy(
            self.pd.decode_router, config.cache_policy, config.sim_seed
        )
        gbs = self.pd.transfer_bandwidth_gbs
        self.bandwidth = self.tier_spec.transfer_bandwidth if gbs is None else gbs * 1e9
        self._handoffs: dict[str, _Handoff] = {}
        self._queues = [deque[str]() for _ in range(y)]  # waiting to reserve, per decode engine
        self._landed: list[list[str]] = [[] for _ in range(y)]  # KV in, not yet decoding
        self._sending: dict[int, str] = {}  # _LAND payload -> rid
        self._link_free = [0.0] * config.engines  # each engine's NIC: free from then on
        self._prefill_tokens = [0] * config.engines  # prompt tokens computed, per engine
        self._sent = {"transfers": 0, "tokens": 0, "seconds": 0.0, "queued_s": 0.0}

    def _routed(self) -> list[_Engine]:
        return self.engines[: self.num_prefill]

    def run(
        self,
        requests: Sequence[WorkloadRequest],
        label: str = "",
        progress: bool = False,
        block_tokens: int | None = None,
    ) -> SimResult:
        res = super().run(requests, label, False, block_tokens)  # no bar: two finishes a request
        res.router = f"{self.config.router}+{self.pd.decode_router}"
        res.pd = self.report()
        return res

    def report(self) -> dict[str, object]:
        """The split, what moved between the engines, and the prompt tokens each computed."""
        n, sent = self.num_prefill, self._sent
        return {
            "prefill_engines": n,
            "decode_engines": len(self.decode),
            "transfer_bandwidth_gbs": self.bandwidth / 1e9,
            **sent,
            "transfer_bytes": sent["tokens"] * self.cost.model.kv_bytes_per_token,
            "prefill_tokens_per_engine": self._prefill_tokens,
        }

    # -- dispatch: a pair ----------------------------------------------------------------------
    def _dispatch(self, i: int) -> None:
        if self._evicting:  # the trees as single steps would have left them
            self._begin_steps()
        w, now = self._reqs[i], self.now
        view = RequestView.from_prompt(input_ids=w.input_ids)
        n, out = len(w.input_ids), w.output_len
        p, d = self._pick_pair(view, out, now)
        preq = Req(w.rid, w.input_ids, self._params(1), arrival_time=now)
        dreq = Req(w.rid, w.input_ids, self._params(out), arrival_time=now)
        try:
            if d is not None:
                check_request(dreq, d.sched.context_length, d.sched.kv.total, d.sched.kv.page)
            p.sched.add_request(preq)
        except ValueError as e:
            self._result.reject(w.rid, str(e))
            self._leave(p, view, n)
            if d is not None:
                self._leave(d, view, n + out)
            self._finished_one(w.rid)
            return
        p.load.requests += 1
        p.load.prompt_tokens += n
        self._live[w.rid] = (preq, p, view)
        if d is not None:
            d.load.requests += 1
            self._handoffs[w.rid] = _Handoff(p, d, dreq)
        self._wake(p)

    def _pick_pair(
        self, view: RequestView, output_len: int, now: float
    ) -> tuple[_Engine, _Engine | None]:
        """The prefill engine by the router's policy, the decode engine by the load policy
        (none for a request of one new token: the prefill engine's token is all of it)."""
        self.policy.tick(now)
        if self._feed is not None:
            self._feed.flush()
            self._views = [e.reported_view(now) for e in self.prefill]
        p = self.prefill[self.policy.select(self._views, view, now)]
        self.policy.on_dispatch(p.idx, view, now)
        self._count(p, len(view.token_ids or ()), 1)
        if output_len < 2:
            return p, None
        self.decode_policy.tick(now)
        j = self.decode_policy.select(self._dviews, view, now)
        self.decode_policy.on_dispatch(j, view, now)
        d = self.decode[j]
        self._count(d, len(view.token_ids or ()) + output_len, 1)
        return p, d

    def _count(self, eng: _Engine, tokens: int, sign: int) -> None:
        """In-flight requests and tokens as the policies see them."""
        eng.requests += sign
        eng.tokens += sign * tokens
        j = eng.idx - self.num_prefill
        if j < 0:
            self._views[eng.idx] = eng.view()
        else:
            self._dviews[j] = WorkerView(j, eng.requests, True, eng.tokens)

    def _leave(self, eng: _Engine, view: RequestView, tokens: int) -> None:
        """A request is done with ``eng``: its policy and load hear of it."""
        self._count(eng, tokens, -1)
        j = eng.idx - self.num_prefill
        policy, worker = (self.policy, eng.idx) if j < 0 else (self.decode_policy, j)
        policy.on_complete(worker, view, self.now)

    # -- steps ---------------------------------------------------------------------------------
    def _step(self, eng: _Engine) -> None:
        """Between steps a decode engine starts what has landed and reserves for what waits."""
        if eng.idx >= self.num_prefill:
            self._between_steps(eng)
        super()._step(eng)
        batch = eng.batch
        if batch is not None and eng.run is None:
            self._prefill_tokens[eng.idx] += sum(
                len(e.token_ids) for e in batch.entries if e.is_prefill
            )

    def _between_steps(self, d: _Engine) -> None:
        j = d.idx - self.num_prefill
        for rid in self._landed[j]:
            h = self._handoffs[rid]
            d.sched.receive(rid, h.first)
        self._landed[j].clear()
        queue = self._queues[j]
        while queue:
            h = self._handoffs[queue[0]]
            if not d.sched.reserve(h.dreq):
                break
            queue.popleft()
            self._send(h)

    # -- the handoff ---------------------------------------------------------------------------
    def _finish(self, rid: str) -> None:
        req, eng, view = self._live[rid]
        if eng.idx >= self.num_prefill or rid not in self._handoffs:
            self._finish_request(rid)
            return
        self._leave(eng, view, len(req.input_ids))
        eng.load.cached_tokens += req.cached_tokens
        h = self._handoffs[rid]
        h.first = req.output_ids[0]
        h.dreq.cached_tokens = req.cached_tokens
        h.dreq.first_scheduled_time = req.first_scheduled_time
        m = eng.sched.cache.match_prefix(req.input_ids)
        if m.length:  # the prompt's KV stays until it has been sent
            h.pinned = m.last_node
            eng.sched.kv.pin(m.last_node)
        self._live[rid] = (h.dreq, h.decode, view)
        self._queues[h.decode.idx - self.num_prefill].append(rid)
        self._wake(h.decode)

    def _send(self, h: _Handoff) -> None:
        """Start the prompt's KV on its way once the prefill engine's and the decode engine's
        links are free; it lands ``tokens x KV bytes per token per GPU / bandwidth`` later."""
        n = len(h.dreq.input_ids)
        p, d = h.prefill.idx, h.decode.idx
        start = max(self.now, self._link_free[p], self._link_free[d])
        end = start + self.cost.transfer_time(n, self.bandwidth)
        self._link_free[p] = self._link_free[d] = end
        self._seq += 1
        self._sending[self._seq] = h.dreq.rid
        heapq.heappush(self._events, (end, _LAND, self._seq, self._seq))
        sent = self._sent
        sent["transfers"] += 1
        sent["tokens"] += n
        sent["seconds"] += end - start
        sent["queued_s"] += start - self.now

    def _land(self, payload: int) -> None:
        """The KV and the first token are on the decode engine: the client has its first
        token; the engine decodes the request from its next step."""
        rid = self._sending.pop(payload)
        h = self._handoffs[rid]
        if h.pinned is not None:
            h.prefill.sched.kv.unpin(h.pinned)
            h.pinned = None
            if h.prefill.sched.num_waiting:  # it may have stopped for want of that room
                self._wake(h.prefill)
        h.dreq.first_token_time = self.now
        self.tbt.start(rid, self.now)
        self._landed[h.decode.idx - self.num_prefill].append(rid)
        self._wake(h.decode)

    def _finish_request(self, rid: str) -> None:
        """The last token: the request is done (on its decode engine, or on its prefill engine
        when one token was all it asked for)."""
        req, eng, view = self._live.pop(rid)
        h = self._handoffs.pop(rid, None)
        self._result.record(req)
        self._result.record_tbt(self.tbt.pop(rid))
        w = self._reqs[self._index[rid]]
        if self._block_tokens and w.hash_ids:
            self._result.record_blocks(req, len(w.hash_ids), self._block_tokens)
        if h is None:
            eng.load.cached_tokens += req.cached_tokens
            self._leave(eng, view, len(req.input_ids))
        else:
            self._leave(eng, view, len(req.input_ids) + req.sampling.max_new_tokens)
        self._finished_one(rid)

    def check_integrity(self) -> None:
        """Every engine's KV accounting, the router's tree, and no handoff left half done."""
        super().check_integrity()
        pinned = sum(1 for h in self._handoffs.values() if h.pinned is not None)
        held = sum(sum(e.sched.kv.pins.values()) for e in self.prefill)
        assert pinned == held, f"{held} pins on prefill engines, {pinned} handoffs hold one"


def simulate_pd(
    requests: Sequence[WorkloadRequest],
    split: tuple[int, int],
    config: ClusterConfig | None = None,
    pd: PDConfig | None = None,
    sched_config: SchedulerConfig | None = None,
    cache_config: CacheConfig | None = None,
    label: str = "",
    block_tokens: int | None = None,
) -> SimResult:
    """Run ``requests`` through a fresh xPyD fleet (``split``: X prefill, Y decode engines)."""
    sim = PDClusterSim(config or ClusterConfig(engines=sum(split)), split, pd, sched_config,
                       cache_config)  # fmt: skip
    return sim.run(requests, label or f"{split[0]}P{split[1]}D", block_tokens=block_tokens)
