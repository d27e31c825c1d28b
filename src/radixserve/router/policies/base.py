"""The router policy interface: plain views of the workers and of a request in, a worker index
out; every hook a caller may use declared with a no-op default. Pure: no I/O, no clock."""

# Policies never do I/O and never read a clock: `now` is passed in, so the proxy (wall time) and
# the discrete-event simulator (virtual time) drive the same code.

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from radixserve.router.kvindex.block_index import BlockIndex
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.tree import MultiTenantTree
from radixserve.router.policies.tree_keys import Namespace, ids_key, namespace, text_key


@dataclass(slots=True, frozen=True)
class WorkerView:
    """What a policy may know of a worker: its id, in-flight requests, health, and the size
    of its in-flight prompts (``queued_tokens``, least_load's tie-break: key units in the
    router, which sees text, tokens in the simulator; only compared between workers), and the
    prefill tokens it reported waiting (``prefill_tokens``, None: no report) at ``reported_at``,
    and the time it takes to load one token of KV over the time it takes to prefill one: from
    its host tier (``kv_load_ratio``) and from a KV store (``kv_store_load_ratio``), as the
    worker measures them (None: not reported; kv_aware's prefill_work says what it charges)."""

    id: Hashable
    load: int = 0
    healthy: bool = True
    queued_tokens: int = 0
    prefill_tokens: int | None = None
    reported_at: float = float("-inf")
    kv_load_ratio: float | None = None
    kv_store_load_ratio: float | None = None


@dataclass(slots=True, frozen=True)
class RequestView:
    """What a policy may know of a request: its packed prefix key and its cache namespace;
    for kv_aware also its token ids as the workers tokenize it and its KV-event namespace
    (kv_event_types.namespace_string), when the router has them."""

    key: bytes
    namespace: Namespace = ()
    token_ids: Sequence[int] | None = None
    kv_namespace: str = ""
    routing_key: bytes = b""  # a session header's value, for consistent_hashing

    @classmethod
    def from_prompt(
        cls,
        text: str | None = None,
        input_ids: Sequence[int] | None = None,
        model: str = "",
        lora: str = "",
        cache_salt: str = "",
    ) -> RequestView:
        """Key on `input_ids` when the request has them (what the engine caches), else the text."""
        if input_ids is not None:
            ns = namespace("ids", model, lora, cache_salt)
            return cls(ids_key(input_ids), ns, input_ids, ns[-1])
        ns = namespace("text", model, lora, cache_salt)
        return cls(text_key(text or ""), ns, None, ns[-1])


class NoWorkerAvailable(RuntimeError):
    """No healthy worker to route to; the proxy answers 503."""


def healthy_indices(workers: Sequence[WorkerView]) -> list[int]:
    """Indices of healthy workers; raises NoWorkerAvailable when there is none."""
    found = [i for i, w in enumerate(workers) if w.healthy]
    if not found:
        raise NoWorkerAvailable("no healthy worker")
    return found


class RouterPolicy(ABC):
    """Picks a worker per request. `select` never changes what the policy believes a worker
    holds: that is recorded in `on_dispatch`, once per attempt (a failed attempt retried
    elsewhere leaves both workers recorded as holding the prefix, as it may have reached the
    first one's cache before failing).

    Every hook a caller may use is declared here with a no-op default, so callers (the proxy,
    its admin API and metrics, the simulator) never probe a policy for what it has. Subclasses
    set `name` (their `--policy` value; registry.py lists them)."""

    name: ClassVar[str] = ""
    index: BlockIndex | None = None
    """The precise KV index the policy reads (kv_aware); None: the policy keeps none."""
    tree: MultiTenantTree | None = None
    """The approximate prefix tree of what was sent to each worker; None: the policy keeps none."""

    def __init__(self, config: CachePolicyConfig | None = None, seed: int = 0) -> None:
        self.config = config or CachePolicyConfig()
        self.rng = random.Random(seed)
        # Where the policy runs beside live traffic (the router), eviction is deferred: the
        # owner sets defer_eviction, watches `evict_due` and runs eviction_slices() between
        # requests, so no request waits on a walk of the whole tree. The simulator evicts inline.
        self.defer_eviction = False
        self.evict_due = False
        # Prompt tokens dispatched, and those the chosen worker held (kv_aware counts them).
        self.prompt_tokens = 0
        self.matched_tokens = 0
        # What the worker chosen at the last on_dispatch was expected to hold: prompt tokens
        # with a KV index, the approximate tree's units without (None: the policy expects none).
        self.last_hit: int | None = None

    @abstractmethod
    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        """Index into `workers` of the worker that should serve `request`."""

    def on_dispatch(self, worker_id: Hashable, request: RequestView, now: float) -> None:  # noqa: B027  (a hook: no-op by default)
        """The request was sent to `worker_id`."""

    def on_complete(self, worker_id: Hashable, request: RequestView, now: float) -> None:  # noqa: B027  (a hook: no-op by default)
        """The request finished on `worker_id` (successfully or not)."""

    def on_worker_removed(self, worker_id: Hashable) -> None:  # noqa: B027  (a hook: no-op by default)
        """`worker_id` left the fleet."""

    def tick(self, now: float) -> None:  # noqa: B027  (a hook: no-op by default)
        """Periodic housekeeping; the caller decides how often to call it."""

    def eviction_slices(self) -> Iterator[int]:
        """The deferred eviction (see `defer_eviction`), in slices of bounded work."""
        self.evict_due = False
        return iter(())

    def pending(self, worker: WorkerView) -> int | None:
        """Prefill tokens `worker` has yet to compute as the policy counts them; None: the
        policy does not count them."""
        return None

    def tree_size(self) -> dict[Hashable, int]:
        """Units the policy's approximate tree holds per worker (empty: no tree)."""
        return {} if self.tree is None else self.tree.sizes()

    def expected_hit_rate(self) -> float:
        """Share of what was dispatched that the chosen worker was expected to hold."""
        return 0.0


def busyness(worker: WorkerView) -> tuple[int, int]:
    """In-flight requests, then in-flight prompt size: the load-only policies' order."""
    return (worker.load, worker.queued_tokens)
