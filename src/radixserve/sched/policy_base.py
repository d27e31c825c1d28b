"""The waiting-queue policy interface: what every order (sched/policy.py) and wrapper
(sched/policy_wrappers.py) implements, and the context a pass may look at."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import SchedulerConfig
from radixserve.sched.request import Req


@dataclass(slots=True)
class PassContext:
    """What a policy may look at besides its own requests during one pass."""

    running_keys: Mapping[str, int] = field(default_factory=dict)  # routing key -> running


class WaitingPolicy:
    """A waiting-queue order. Rule for callers: nothing is added, removed or updated while an
    ``order()`` iterator is in use; apply those changes after the pass."""

    cache_aware = False  # orders by cached prefix (enables in-batch prefix dedupe)

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def __len__(self) -> int:
        raise NotImplementedError

    def add(self, req: Req) -> None:
        raise NotImplementedError

    def remove(self, req: Req) -> None:
        raise NotImplementedError

    def update(self, req: Req, old_node: Any) -> None:
        """``req``'s cached-prefix match changed (it was at ``old_node``)."""

    def on_split(self, upper: Any, lower: Any) -> None:
        """The tree cut ``lower`` in two; ``upper`` is the new node above it."""

    def order(self, ctx: PassContext) -> Iterator[Req]:
        """Waiting requests, best first, lazily: a pass pays only for what it consumes."""
        raise NotImplementedError

    def check(self, waiting: list[Req]) -> None:
        """Recount the policy's incremental state against ``waiting`` (integrity checks)."""
        assert len(self) == len(waiting), "policy and waiting queue disagree"
