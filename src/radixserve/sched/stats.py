"""The scheduler's counters and stats, run-time settings changes (the waiting queue's order
only) and the integrity recount. ``SchedulerStats`` is the snapshot the engine reports; the
rest is mixed into ``Scheduler``."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from radixserve.config import SchedulerConfig
from radixserve.sched.kv import KVManager
from radixserve.sched.policy import make_policy
from radixserve.sched.request import ReqState
from radixserve.sched.running import RunningSet
from radixserve.sched.validate import check_config

# What update_settings may change while requests run: the waiting queue's order only.
RUNTIME_SETTINGS = frozenset(("schedule_policy", "max_wait_ms", "enable_priority_scheduling",
                              "priority_preemption_threshold"))  # fmt: skip


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # share of the KV pool neither free nor evictable
    cache_hit_rate: float  # cached prompt tokens / prompt tokens, at first admission
    prompt_tokens: int
    cached_prompt_tokens: int
    num_finished: int
    num_aborted: int
    num_retracted: int  # retractions for KV (and preemptions for priority) so far
    new_token_ratio: float
    # prompt tokens queued or mid-chunk and not yet computed (a kv_aware router reads them)
    waiting_prefill_tokens: int = 0
    host_cached_prompt_tokens: int = 0  # of cached_prompt_tokens, loaded from the host tier
    host_tier_tokens: int = 0  # host-tier slots holding KV
    host_tier_total: int = 0  # host-tier slots (0: no host tier)


class Metrics:
    """num_running / num_waiting / cache_hit_rate / stats, update_settings, check_integrity."""

    config: SchedulerConfig
    kv: KVManager
    running: RunningSet

    # -- metrics and integrity ---------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def cache_hit_rate(self) -> float:
        return self._n["cached"] / self._n["prompt"] if self._n["prompt"] else 0.0

    def stats(self) -> SchedulerStats:
        n = self._n
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_usage=self.kv.usage(),
            cache_hit_rate=self.cache_hit_rate,
            prompt_tokens=n["prompt"],
            cached_prompt_tokens=n["cached"],
            num_finished=n["finished"],
            num_aborted=n["aborted"],
            num_retracted=n["retracted"],
            new_token_ratio=self.running.ratio,
            waiting_prefill_tokens=self.waiting_prefill_tokens(),
            host_cached_prompt_tokens=n["host_cached"],
            host_tier_tokens=self.kv.cache.host_size(),
            host_tier_total=self.kv.host.total if self.kv.host is not None else 0,
        )

    def waiting_prefill_tokens(self) -> int:
        """Tokens still to prefill: waiting requests beyond their cached match, plus what
        is left of the request being prefilled in chunks."""
        left = sum(
            r.fill_len - max(r.kv_len, r.match_len)
            for r in self._reqs.values()
            if r.state is ReqState.WAITING
        )
        chunked = self.running.chunked
        return left + (chunked.fill_len - chunked.kv_len if chunked is not None else 0)

    # -- settings changed at run time ----------------------------------------------------------
    def update_settings(self, **changes: object) -> SchedulerConfig:
        """Change how the waiting queue is ordered (RUNTIME_SETTINGS) without a restart: a new
        frozen config and a new policy that takes over every waiting request, in the order
        they queued; running requests and the cache are untouched. Raises ValueError (and
        changes nothing) for a setting that cannot change or a value that is not valid."""
        unknown = sorted(set(changes) - RUNTIME_SETTINGS)
        if unknown:
            raise ValueError(f"cannot change {', '.join(unknown)} at run time; these can: "
                             f"{', '.join(sorted(RUNTIME_SETTINGS))}")  # fmt: skip
        config = dataclasses.replace(self.config, **changes)
        check_config(config, self.kv.page)
        policy = make_policy(config, self.clock, self.kv.enabled)
        waiting = [r for r in self._reqs.values() if r.state is ReqState.WAITING]
        for req in sorted(waiting, key=lambda r: (r.queued_at, r.seq)):  # bounded wait's order
            policy.add(req)
        self.config = self.running.config = config
        self.policy = policy
        self.index.on_move, self.index.split_hook = policy.update, policy.on_split
        return config

    def check_integrity(self) -> None:
        """Recount everything: free + evictable + protected + held == total, the tree's own
        counters, every lock, and the queue against the prefix index."""
        running = [*self.running.all(), *self.receiving.values()]
        self.kv.check([*running, *self.held.values()], in_flight=self._in_flight is not None)
        waiting = [r for r in self._reqs.values() if r.state is ReqState.WAITING]
        assert len(waiting) + len(running) == len(self._reqs), "a request is lost"
        self.policy.check(waiting)
        assert all(r.state is ReqState.RUNNING for r in running)
        keys = Counter(r.routing_key for r in running if r.routing_key is not None)
        assert keys == self.running.keys, "running routing keys miscounted"
        self.index.check(waiting)
