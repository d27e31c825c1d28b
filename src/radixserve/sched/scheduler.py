"""Scheduler: continuous batching over a radix prefix cache, for any runner.

``step() -> Batch`` and ``on_output(batch, result) -> tokens``; no torch, no I/O, and time only
from the injected clock, so the engine, the simulated engine and the simulator share it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

from radixserve.cache.pool import RequestSlotTable, SlotAllocator
from radixserve.cache.radix import RadixCache
from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.adder import AddResult, PrefillAdder
from radixserve.sched.batch import Batch, BatchEntry, StepResult
from radixserve.sched.decode_run import RunEvictions
from radixserve.sched.decode_runs import DecodeRuns
from radixserve.sched.disagg import DisaggRole
from radixserve.sched.kv import KVManager
from radixserve.sched.policy import PassContext, make_policy, orders_by_priority
from radixserve.sched.prefix_index import PrefixIndex
from radixserve.sched.request import FinishReason, Req, ReqState, TokenOutput
from radixserve.sched.retract import Retraction
from radixserve.sched.running import RunningSet
from radixserve.sched.stats import RUNTIME_SETTINGS, Metrics, SchedulerStats
from radixserve.sched.validate import check_config, check_request

__all__ = ["MAX_DEDUPE_SKIPS", "RUNTIME_SETTINGS", "Scheduler", "SchedulerStats"]

# In-batch dedupe skips at most this many requests per pass, so a crowd of requests that share
# one uncached prefix cannot make a pass scan the whole queue; they are matched next step.
MAX_DEDUPE_SKIPS = 128


def _entry(req: Req, tokens: list[int], start: int, slots: list[int], prefill: bool) -> BatchEntry:
    sample = start + len(tokens) == req.fill_len or not prefill
    return BatchEntry(
        req.rid, tokens, start, slots, sample, req.sampling, prefill, req.num_generated,
        req.input_ids, req.output_ids,
    )  # fmt: skip


class Scheduler(DisaggRole, DecodeRuns, Retraction, Metrics):
    """Owns the waiting queue, the running requests and their KV (radix cache, slot allocator,
    slot table). Call ``step()``, run the batch, then ``on_output()`` with its result; requests
    come in with ``add_request`` and leave finished (``on_output``, ``finish``) or aborted.
    """

    def __init__(
        self,
        sched_config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
        eos_token_ids: Iterable[int] = (),
        context_length: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        host_tokens: int = 0,
    ) -> None:
        # settings left to the device: a GPU's unless the caller resolved them for its own
        # (EngineConfig does, for the model's device)
        self.config = (sched_config or SchedulerConfig()).for_device("cuda")
        self.kv = KVManager(cache_config or CacheConfig(), host_tokens)
        check_config(self.config, self.kv.page)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.clock = clock
        self.policy = make_policy(self.config, clock, self.kv.enabled)
        self.index = PrefixIndex(
            self.kv.cache, self.kv.enabled, self.policy.update, self.policy.on_split
        )
        self.running = RunningSet(self.config)
        self._reqs: dict[str, Req] = {}  # every live request, waiting or running
        self.receiving: dict[str, Req] = {}  # decode role: slots reserved, KV on its way
        self._holding: set[str] = set()  # prefill role: when these end, their slots stay...
        self.held: dict[str, Req] = {}  # ...held (ended, pages still being read) until released
        self._in_flight: Batch | None = None
        self._last_chunk = False
        self._seq = self._step_id = 0
        self._run: RunEvictions | None = None  # a booked run of decode steps (simulator)
        self.run_evictions = 0  # steps inside booked runs that evicted from the tree
        self._n = Counter[str]()  # prompt, cached, finished, aborted, retracted

    # -- the three owned pieces, for engines and tests ---------------------------------------
    @property
    def cache(self) -> RadixCache:
        return self.kv.cache

    @property
    def allocator(self) -> SlotAllocator:
        return self.kv.allocator

    @property
    def slot_table(self) -> RequestSlotTable:
        return self.kv.table

    # -- requests in and out -----------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a fresh request; raises ValueError (and keeps nothing) if it can never run."""
        if req.rid in self._reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        check_request(req, self.context_length, self.kv.total, self.kv.page)
        now = self.clock()
        if req.arrival_time is None:
            req.arrival_time = now
        req.queued_at = now
        self._seq += 1
        req.seq = self._seq
        self._reqs[req.rid] = req
        self._enqueue(req)

    def abort(self, rid: str) -> bool:
        """End a request wherever it is and free everything it holds. False if unknown."""
        return self._end(rid, ReqState.ABORTED, FinishReason.ABORT)

    def finish(self, rid: str, reason: FinishReason = FinishReason.STOP) -> bool:
        """End a request for a reason found outside (a stop string after detokenizing)."""
        return self._end(rid, ReqState.FINISHED, reason)

    def get(self, rid: str) -> Req | None:
        return self._reqs.get(rid)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while any request is waiting or running, or
        a reader outside the scheduler has nodes pinned (``KVManager.pin``)."""
        if self._reqs or self.held or self._in_flight is not None or self.kv.pins:
            return False
        self.kv.flush()
        return True

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> Batch | None:
        """The next batch: a prefill if one can be admitted, else a decode (None: idle)."""
        if self._in_flight is not None:
            raise RuntimeError("step() called before on_output() of the previous batch")
        self._make_room_for_chunk()
        mixed = self.config.enable_mixed_chunk
        decodes = self._decode_entries() if mixed or self._decode_turn() else []
        prefills = [] if decodes and not mixed else self._prefill_entries(len(decodes))
        if not prefills:
            self._last_chunk = False
            decodes = decodes or self._decode_entries()
        if not prefills and not decodes:
            self.running.reset_ratio()  # idle: start afresh
            return None
        self._step_id += 1
        self._in_flight = Batch(prefills + decodes, self._step_id, self.kv.take_copies())
        return self._in_flight

    def on_output(self, batch: Batch, result: StepResult) -> list[TokenOutput]:
        """Take the runner's tokens for ``batch``: append, finish, cache. Entries of requests
        aborted while the batch ran are skipped."""
        if batch is not self._in_flight:
            raise ValueError("on_output() takes the batch that the last step() returned")
        if len(result.next_token_ids) != len(batch.entries):
            raise ValueError("a StepResult needs one next token id per batch entry")
        self._in_flight = None
        outs = []
        reqs, running = self._reqs, ReqState.RUNNING
        for entry, token in zip(batch.entries, result.next_token_ids):
            req = reqs.get(entry.rid)
            if req is None or req.state is not running:
                continue
            req.kv_len += len(entry.token_ids)
            if not entry.sample:
                self.kv.cache_unfinished(req)
            elif token is None:
                raise ValueError(f"no next token for sampled entry {entry.rid!r}")
            else:
                outs.append(self._append(req, token, entry.is_prefill))
        return outs

    def _append(self, req: Req, token: int, was_prefill: bool) -> TokenOutput:
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        reason = self._stop_reason(req, token)
        if reason is not None:
            self._end(req.rid, ReqState.FINISHED, reason)
        elif was_prefill:
            self.kv.cache_unfinished(req)  # so requests that share its prompt match it now
        return TokenOutput(
            req.rid, token, reason is not None, reason, req.cached_tokens, req.host_cached_tokens
        )

    def _stop_reason(self, req: Req, token: int) -> FinishReason | None:
        sp = req.sampling
        if len(req.output_ids) < sp.min_new_tokens:  # a runner that cannot mask them
            return None
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        # add_request made prompt + max_new_tokens fit the context, so this bound is enough
        if len(req.output_ids) >= sp.max_new_tokens:
            return FinishReason.LENGTH
        return None

    # -- prefill -----------------------------------------------------------------------------
    def _decode_turn(self) -> bool:
        # a long prompt prefilled in chunks alternates with decode steps, so running requests
        # keep generating while it is prefilled (with mixed chunks they share every step)
        return self.running.chunked is not None and bool(self.running.decoding) and self._last_chunk

    def _prefill_entries(self, num_decodes: int) -> list[BatchEntry]:
        chunked = self.running.chunked
        if chunked is None and not len(self.policy):
            return []
        self.index.refresh()
        adder = PrefillAdder(
            self.config,
            self.kv.page,
            self.kv.room,
            self.running.reserved(),
            len(self.running.decoding),
            self.policy.cache_aware,
        )
        adder.add_decodes(num_decodes)
        if chunked is not None:
            adder.add_chunk(chunked, chunked.locked_node)
        victims = self._admit(adder, busy=num_decodes > 0)
        return self._start(adder, victims) if adder.admitted else []

    def _admit(self, adder: PrefillAdder, busy: bool) -> list[Req]:
        """Offer waiting requests in policy order until a budget runs out; returns the running
        requests to preempt for them (none when decodes share the step: they are ``busy``)."""
        victims: list[Req] = []
        skips = 0
        for req in self.policy.order(PassContext(self.running.keys)):
            res = self._offer(adder, req, None if busy else victims)
            if res is AddResult.SKIPPED:
                skips += 1
                if skips > MAX_DEDUPE_SKIPS:
                    break
            elif res is not AddResult.ADDED:
                break
        return victims

    def _offer(self, adder: PrefillAdder, req: Req, victims: list[Req] | None) -> AddResult:
        # lock first: a prefix pinned by this request no longer counts as evictable room
        self.kv.lock(req.match_node)
        res = adder.add(req)
        if res in (AddResult.NO_TOKEN, AddResult.NO_SLOT) and victims is not None:
            picked, freed = self._pick_victims(req, adder, victims)
            if picked:
                adder.credit(freed, len(picked))
                res = adder.add(req)
                if res is AddResult.ADDED:
                    victims.extend(picked)
                else:
                    adder.credit(-freed, -len(picked))
        if res is not AddResult.ADDED:
            self.kv.unlock(req.match_node)
        return res

    def _pick_victims(
        self, req: Req, adder: PrefillAdder, taken: list[Req]
    ) -> tuple[list[Req], float]:
        threshold = self.config.priority_preemption_threshold
        cfg = self.config
        if threshold is None or not orders_by_priority(
            cfg.schedule_policy, cfg.enable_priority_scheduling
        ):
            return [], 0.0
        short_kv, short_slots = adder.kv_short(req, req.prefix_len), 1 - adder.rem_slots
        return self.running.pick_victims(
            req, threshold, taken, short_kv, short_slots, self.kv.held_by
        )

    def _start(self, adder: PrefillAdder, victims: list[Req]) -> list[BatchEntry]:
        """Apply a finished pass: dequeue the admitted, retract the preempted, allocate."""
        fresh = [a.req for a in adder.admitted if a.req.state is ReqState.WAITING]
        for req in fresh:
            self._dequeue(req)
        for req in victims:
            self._retract(req)
        loaded = self._load_host(adder) if self.kv.host is not None else {}
        for req in fresh:
            self._start_running(req, loaded.get(req.rid, 0))
        # evict for the whole batch at once: each eviction walks the tree
        self.kv.ensure_free(sum(self.kv.extend_cost(a.req, a.extend_len) for a in adder.admitted))
        entries = []
        for adm in adder.admitted:
            req = adm.req
            self.kv.extend(req, adm.extend_len)
            if adm.completes:
                self.running.decoding[req.rid] = req  # decodes once this prefill returns
            tokens = req.fill_slice(adm.start, adm.end)
            entries.append(_entry(req, tokens, adm.start, self.kv.table.slots(req.rid), True))
        self.running.chunked = adder.chunked.req if adder.chunked else None
        self._last_chunk = adder.chunked is not None
        return entries

    def _load_host(self, adder: PrefillAdder) -> dict[str, int]:
        """Fresh admissions whose prefix continues in the host tier load it instead of
        computing it: the same slots, fewer tokens to compute (at least one still is)."""
        loaded = {}
        for adm in adder.admitted:
            req = adm.req
            if req.state is not ReqState.WAITING or adm.start != req.prefix_len:
                continue
            n = self.kv.load_host(req, adm.extend_len - 1)
            if n:
                adm.start += n
                adm.extend_len -= n
                loaded[req.rid] = n
        return loaded

    def _start_running(self, req: Req, from_host: int = 0) -> None:
        self.kv.open(req)
        req.state = ReqState.RUNNING
        self.running.enter(req)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
            req.cached_tokens = req.prefix_len
            req.host_cached_tokens = from_host
            self._n["host_cached"] += from_host
            self._n["prompt"] += len(req.input_ids)
            self._n["cached"] += req.prefix_len

    # -- bookkeeping -------------------------------------------------------------------------
    def _enqueue(self, req: Req) -> None:
        self.index.track(req)
        self.policy.add(req)

    def _dequeue(self, req: Req) -> None:
        self.index.untrack(req)
        self.policy.remove(req)

    def _end(self, rid: str, state: ReqState, reason: FinishReason) -> bool:
        req = self._reqs.pop(rid, None)
        if req is None:
            return False
        if req.state is ReqState.WAITING:
            self._dequeue(req)
        else:
            self.running.leave(req)  # KV still on its way is not cached
            if rid in self._holding:
                self.held[rid] = req
            else:
                self.kv.release(req, keep=self.receiving.pop(rid, None) is None)
        req.state, req.finish_reason, req.finish_time = state, reason, self.clock()
        self._n["aborted" if state is ReqState.ABORTED else "finished"] += 1
        return True
