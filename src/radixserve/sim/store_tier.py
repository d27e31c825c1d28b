"""The simulator's fleet-wide KV store hooks, mixed into ClusterSim: the store lookup at
dispatch, the planned get on an engine's link, landing the loaded prefix in an engine's tree,
the refetch at admission of a prefix evicted while it waited, and writing computed blocks."""

from __future__ import annotations

from array import array

from radixserve.cache.radix import MatchResult
from radixserve.cache.tokens import concat_tokens
from radixserve.sched.policy import PassContext
from radixserve.sched.request import Req
from radixserve.sim.engine_state import _Engine
from radixserve.sim.tiers import Landing


class StoreTier:
    """ClusterSim's store-tier methods (state lives on ClusterSim)."""

    def _store_lookup(self, rid: str, ids: array) -> int:
        """Leading prompt tokens the store holds (whole blocks, never the last token), told to
        kv_aware as loadable by every engine."""
        store = self.store
        assert store is not None
        self._store_rids.add(rid)
        b = store.block
        held = min(store.leading(ids), (len(ids) - 1) // b) * b
        self._store_source.tokens = dict.fromkeys(range(len(self.engines)), held) if held else {}
        return held

    def _matched(self, eng: _Engine, ids: list[int], end: int) -> tuple[MatchResult, int]:
        """``eng``'s device match of ``ids`` and how far its host tier continues it (to ``end``)."""
        cache = eng.sched.cache
        m = cache.match_prefix(ids)
        host = 0
        if eng.sched.kv.host is not None and end > m.length:
            host = sum(len(n.key) for n in cache.match_host(ids, m.last_node, m.length, end))
        return m, host

    def _plan_load(self, eng: _Engine, req: Req, held: int) -> float | None:
        """When the store holds more of the prompt than ``eng``'s device and host tiers, start
        its get on ``eng``'s link: the time it lands; None: nothing to load from the store."""
        m, host = self._matched(eng, req.input_ids, held)
        below = held - m.length - host  # what only the store has
        if below <= 0:
            return None
        start = max(self.now, eng.link_free)
        eng.link_free = start + self.cost.store_load_time(below, self.tier_spec)
        return eng.link_free + self.cost.host_load_time(held - m.length, self.tier_spec)

    def _land(self, payload: int) -> None:
        """A store load landed: it is applied when its engine is between steps (a step in
        flight, or a booked decode run, counts on the slots it saw free)."""
        rid, held = self._loading.pop(payload)
        eng = self._live[rid][1]
        eng.landed.append((rid, held))
        self._wake(eng)

    def _apply_landed(self, eng: _Engine) -> None:
        for rid, held in eng.landed:
            self._apply_load(eng, rid, held)
        eng.landed.clear()

    def _apply_load(self, eng: _Engine, rid: str, held: int) -> None:
        """The landed pages join the engine's tree, and the request joins the queue."""
        req = self._live[rid][0]
        self._load_prefix(eng, req, held)
        eng.sched.add_request(req)

    def _load_prefix(self, eng: _Engine, req: Req, held: int) -> bool:
        """Put ``req``'s first ``held`` tokens, read from the store, in ``eng``'s tree below its
        device match (host pages on the way revived); False: no room (nothing loaded)."""
        store = self.store
        assert store is not None
        m, host = self._matched(eng, req.input_ids, held)
        n = held - m.length
        if n <= 0:
            return False
        kv, cache = eng.sched.kv, eng.sched.cache
        cache.lock(m.last_node)  # eviction below must not take the prefix it continues
        loaded = kv.ensure_free(n)
        if loaded:
            slots = m.slots + kv.allocator.alloc(n)
            cache.insert(req.input_ids[:held], slots)
            store.read_blocks(req.input_ids, held // store.block)
            self._landings[req.rid] = Landing(m.length, host, n - host)
        cache.unlock(m.last_node)
        return loaded

    def _refetch(self, eng: _Engine) -> float:
        """Admission looks the store up again: the fresh requests the coming step may admit
        (the waiting queue in its order, up to a step's prefill budget) whose prefix the store
        holds beyond ``eng``'s device and host match now (evicted while they waited) get it
        loaded before the step, one get each on ``eng``'s link. Returns when the last lands
        plus its host -> device copy (``now``: nothing loaded); the step waits for it."""
        store, sched = self.store, eng.sched
        assert store is not None
        budget = self.sched_config.max_prefill_tokens
        fresh: list[Req] = []
        for req in sched.policy.order(PassContext(sched.running.keys)):
            if budget <= 0:
                break
            budget -= req.fill_len - req.match_len  # as the pass will see it, give or take
            if req.first_scheduled_time is None:  # a retracted one had its prefix in its cache
                fresh.append(req)
        picks: list[tuple[Req, int]] = []
        b = store.block
        for req in fresh:  # after the pass: a match may split the tree the order reads
            ids = req.input_ids
            held = min(store.leading(ids), (len(ids) - 1) // b) * b
            if held > req.match_len:
                picks.append((req, held))
        ready = self.now
        for req, held in picks:  # after the pass: a load changes the tree the order reads
            m, host = self._matched(eng, req.input_ids, held)
            below = held - m.length - host
            if below <= 0 or not self._load_prefix(eng, req, held):
                continue
            start = max(self.now, eng.link_free)
            eng.link_free = start + self.cost.store_load_time(below, self.tier_spec)
            up = eng.link_free + self.cost.host_load_time(held - m.length, self.tier_spec)
            ready = max(ready, up)
            self.refetched += 1
        return ready

    def _write_store(self, rid: str, ids: array, output: list[int] | None = None) -> None:
        """Write a request's computed blocks: its prompt; with ``output``, its reply too (the
        last token's KV is never computed)."""
        store = self.store
        assert store is not None
        if rid in self._store_rids:
            store.write(concat_tokens(ids, output[:-1]) if output else ids)
