"""Waiting-queue policies: the order in which waiting requests are offered for admission.

A registry of named orders (``--schedule-policy``) plus two wrappers: priority levels and
bounded waiting. Every order is maintained incrementally, so one pass costs what it yields.
The interface is in sched/policy_base.py, the wrappers in sched/policy_wrappers.py.
"""

from __future__ import annotations

import random
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from typing import Any

from radixserve.config import SchedulerConfig
from radixserve.sched.keyed_heap import KeyedHeap
from radixserve.sched.policy_base import PassContext, WaitingPolicy
from radixserve.sched.policy_wrappers import BoundedWait, PriorityQueues
from radixserve.sched.request import Req

POLICIES: dict[str, type[WaitingPolicy]] = {}


def register(name: str) -> Callable[[type[WaitingPolicy]], type[WaitingPolicy]]:
    def deco(cls: type[WaitingPolicy]) -> type[WaitingPolicy]:
        POLICIES[name] = cls
        return cls

    return deco


class _SortedPolicy(WaitingPolicy):
    """A policy whose order is a per-request key (ending in the arrival number, so unique)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._heap = KeyedHeap()

    def key(self, req: Req) -> tuple:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, req: Req) -> None:
        self._heap.put(req, self.key(req))

    def remove(self, req: Req) -> None:
        self._heap.discard(req)

    def order(self, ctx: PassContext) -> Iterator[Req]:
        return iter(self._heap)

    def check(self, waiting: list[Req]) -> None:
        super().check(waiting)
        keys = self._heap.keys()
        for req in waiting:
            assert keys.get(req) == self.key(req), f"{req.rid}: stale order key"


# fcfs: first come, first served. Arrival order (a retracted request keeps its place), blind
# to the cache. The baseline every cache-aware policy is measured against.
@register("fcfs")
class Fcfs(_SortedPolicy):
    def key(self, req: Req) -> tuple:
        return (req.seq,)


# lpm: longest prefix match first (SGLang's default). A request whose cached prefix is longest
# costs the least to prefill and, run now, keeps that prefix hot for the next ones. Ties go in
# arrival order. SGLang re-matches and re-sorts the whole queue every pass and falls back to
# FCFS above 128 waiting requests; here each request's match is kept current by the
# PrefixIndex (only tree changes that touch it re-match it) and the order is a heap re-keyed
# on those changes, so a pass costs O(k log k) for the k requests it looks at, at any queue
# length. Pair it with --max-wait-ms: pure LPM starves a cold request under a hot stream.
# With a host tier the match counts device + host tokens (as SGLang's HiCache LPM does: a host
# hit is loaded, not computed, at a load-to-prefill ratio of ~0.01-0.1); on a tie the longer
# device part goes first (its KV costs nothing to use).
@register("lpm")
class LongestPrefixMatch(_SortedPolicy):
    cache_aware = True

    def key(self, req: Req) -> tuple:
        return (-(req.prefix_len + req.host_len), -req.prefix_len, req.seq)

    def update(self, req: Req, old_node: Any) -> None:
        self.add(req)


# lof: longest output first (by max_new_tokens), then arrival. Long generations start early,
# so the batch's tail is not one long request decoding alone.
@register("lof")
class LongestOutputFirst(_SortedPolicy):
    def key(self, req: Req) -> tuple:
        return (-req.sampling.max_new_tokens, req.seq)


# random: a fresh uniformly random order every pass (seeded by --seed, so runs repeat). The
# shuffle is lazy (Fisher-Yates step by step), so a pass pays per request it consumes plus one
# C-speed copy of the queue.
@register("random")
class RandomOrder(WaitingPolicy):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._rng = random.Random(config.seed)
        self._items: list[Req] = []
        self._pos: dict[Req, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, req: Req) -> None:
        self._pos[req] = len(self._items)
        self._items.append(req)

    def remove(self, req: Req) -> None:
        i = self._pos.pop(req)
        last = self._items.pop()
        if last is not req:
            self._items[i] = last
            self._pos[last] = i

    def order(self, ctx: PassContext) -> Iterator[Req]:
        items, rng = list(self._items), self._rng
        for i in range(len(items)):
            j = rng.randrange(i, len(items))
            items[i], items[j] = items[j], items[i]
            yield items[i]


# routing-key: requests whose routing key is most common in the running batch go first (ties by
# key), the rest in arrival order. Requests of one tenant or session share context, so running
# them together reuses the prefixes that are already locked in.
@register("routing-key")
class RoutingKey(WaitingPolicy):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._all = KeyedHeap()
        self._groups: dict[str, KeyedHeap] = {}

    def __len__(self) -> int:
        return len(self._all)

    def add(self, req: Req) -> None:
        self._all.put(req, (req.seq,))
        if req.routing_key is not None:
            self._groups.setdefault(req.routing_key, KeyedHeap()).put(req, (req.seq,))

    def remove(self, req: Req) -> None:
        self._all.discard(req)
        group = self._groups.get(req.routing_key)  # type: ignore[arg-type]
        if group is not None:
            group.discard(req)
            if not group:
                del self._groups[req.routing_key]  # type: ignore[arg-type]

    def order(self, ctx: PassContext) -> Iterator[Req]:
        counts = ctx.running_keys
        hot = sorted(
            (k for k in self._groups if counts.get(k, 0) > 0), key=lambda k: (-counts[k], k)
        )
        for k in hot:
            yield from self._groups[k]
        first = set(hot)
        for req in self._all:
            if req.routing_key not in first:
                yield req


# dfs-weight: requests grouped by the subtree their cached prefix ends in, heaviest subtree
# first (weight = waiting requests in it), depth first; inside a node, deeper children before
# the requests that end at the node itself, then arrival order. Requests sharing a prefix run
# back to back, so the prefix is computed once and stays locked while they run. SGLang
# rebuilds the weights from the whole queue every pass; here a node's weight is updated when a
# request arrives, leaves or moves (O(depth)), and a pass walks only the nodes it yields from.
@register("dfs-weight")
class DfsWeight(WaitingPolicy):
    cache_aware = True

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._own: dict[Any, list[tuple[int, Req]]] = {}  # node -> its requests by arrival
        self._weight: dict[Any, int] = {}  # node -> waiting requests in its subtree (> 0)
        self._kids: dict[Any, dict[Any, None]] = {}  # node -> children with weight > 0
        self._node_of: dict[Req, Any] = {}
        self._root: Any = None

    def __len__(self) -> int:
        return len(self._node_of)

    def add(self, req: Req) -> None:
        node = req.match_node
        self._node_of[req] = node
        insort(self._own.setdefault(node, []), (req.seq, req))
        self._bump(node, 1)

    def remove(self, req: Req) -> None:
        node = self._node_of.pop(req)
        own = self._own[node]
        del own[bisect_left(own, (req.seq,))]
        if not own:
            del self._own[node]
        self._bump(node, -1)

    def update(self, req: Req, old_node: Any) -> None:
        self.remove(req)
        self.add(req)

    def _bump(self, node: Any, delta: int) -> None:
        """Add ``delta`` to the weight of ``node`` and its ancestors. An evicted node keeps its
        parent pointer, so its requests' weight can still be walked off it."""
        while node is not None:
            w = self._weight.get(node, 0) + delta
            parent = node.parent
            if w:
                self._weight[node] = w
            else:
                del self._weight[node]
            if parent is None:
                self._root = node
            elif w == 0:
                kids = self._kids[parent]
                del kids[node]
                if not kids:
                    del self._kids[parent]
            elif w == delta:  # was 0
                self._kids.setdefault(parent, {})[node] = None
            node = parent

    def on_split(self, upper: Any, lower: Any) -> None:
        w = self._weight.get(lower)
        if not w:
            return
        self._weight[upper] = w
        kids = self._kids[upper.parent]
        del kids[lower]
        kids[upper] = None
        self._kids[upper] = {lower: None}

    def check(self, waiting: list[Req]) -> None:
        """Recount every subtree weight and child set from the requests' nodes."""
        super().check(waiting)
        weight: dict[Any, int] = {}
        kids: dict[Any, dict[Any, None]] = {}
        for req in waiting:
            assert self._node_of[req] is req.match_node, f"{req.rid}: stale node"
            node = req.match_node
            while node is not None:
                weight[node] = weight.get(node, 0) + 1
                if node.parent is not None:
                    kids.setdefault(node.parent, {})[node] = None
                node = node.parent
        assert weight == self._weight, "dfs-weight: subtree weights miscounted"
        assert {n: set(k) for n, k in kids.items()} == {n: set(k) for n, k in self._kids.items()}, (
            "dfs-weight: child sets wrong"
        )

    def _heaviest_first(self, node: Any) -> Iterator[Any]:
        return iter(sorted(self._kids.get(node, ()), key=self._weight.__getitem__, reverse=True))

    def order(self, ctx: PassContext) -> Iterator[Req]:
        if self._root not in self._weight:
            return
        stack = [(self._root, self._heaviest_first(self._root))]
        while stack:  # iterative post-order walk: trees can be deeper than Python's recursion
            node, kids = stack[-1]
            kid = next(kids, None)
            if kid is not None:
                stack.append((kid, self._heaviest_first(kid)))
                continue
            stack.pop()
            for _, req in self._own.get(node, ()):
                yield req


# priority: FCFS inside priority levels, larger priority first; the same as fcfs with
# --enable-priority-scheduling, registered so that --schedule-policy priority reads naturally.
register("priority")(Fcfs)


def orders_by_priority(schedule_policy: str, enable_priority_scheduling: bool) -> bool:
    """The priority rule: requests' priorities order the waiting queue (and may preempt) under
    --enable-priority-scheduling or --schedule-policy priority; elsewhere a priority means
    nothing (and the server refuses one)."""
    return enable_priority_scheduling or schedule_policy == "priority"


def make_policy(
    config: SchedulerConfig, clock: Callable[[], float], cache_enabled: bool = True
) -> WaitingPolicy:
    """The configured queue: the named policy, wrapped for bounded waiting and priorities.
    Without a radix cache the cache-aware policies become FCFS: there is nothing to match."""
    name = config.schedule_policy
    if name not in POLICIES:
        raise ValueError(f"unknown schedule policy {name!r}; choose from {sorted(POLICIES)}")
    cls = POLICIES[name]
    if cls.cache_aware and not cache_enabled:
        cls = Fcfs
    by_priority = orders_by_priority(name, config.enable_priority_scheduling)

    def make() -> WaitingPolicy:
        policy = cls(config)
        if config.max_wait_ms is not None and cls is not Fcfs:
            policy = BoundedWait(policy, config.max_wait_ms / 1000.0, clock)
        return policy

    return PriorityQueues(config, make) if by_priority else make()
