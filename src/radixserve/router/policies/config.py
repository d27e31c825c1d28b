"""CachePolicyConfig: the settings of the prefix-aware policies (cache_aware, kv_aware), named as
sglang-router's flags. One dataclass, nested whole into `route`'s RouterConfig and the
simulator's ClusterConfig, so a new knob is one field here and a flag of both commands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(slots=True, frozen=True)
class CachePolicyConfig:
    """Flags of the cache-aware policy, named as sglang-router's; see CacheAwarePolicy."""

    cache_threshold: float = _f(
        0.5, "cache_aware: least prefix match rate that keeps a request local"
    )
    balance_abs_threshold: int = _f(32, "cache_aware: load gap (requests) tolerated for locality")
    balance_rel_threshold: float = _f(1.0001, "cache_aware: load ratio tolerated for locality")
    eviction_interval_secs: float = _f(
        60.0, "cache_aware: seconds (virtual in `sim`) between tree evictions (0: never)"
    )
    # Units of 8 bytes per worker, counting each tree node as 60 units beside its key bytes
    # (8 ASCII characters or 2 tokens per unit): 2**20 units is about 8 MiB of router memory per
    # worker, up to 2M tokens of prompts, as much as the KV cache of a typical GPU worker.
    max_tree_size: int = _f(
        2**20, "cache_aware: tree units kept per worker (8 prompt bytes; a node costs 60)"
    )
    # Not in sglang-router: see CacheAwarePolicy (step 3); float("inf") turns it off.
    share_slack: float = _f(
        0.03,
        "cache_aware: a prefix's holder sent more than this fraction above the mean share of "
        "recent requests spills hits to the least-sent worker (inf: never)",
    )
    # kv_aware (kv_aware.py): prompts shorter than this are placed by load alone (Llumnix's flag).
    cache_aware_scheduling_min_tokens: int = _f(
        16, "kv_aware: prompts shorter than this (tokens) are placed by load alone"
    )
    # Not in sglang-router: a joining worker's cap on new prefixes ramps up over this (warmup.py).
    warmup_secs: float = _f(
        60.0,
        "cache_aware: a worker that joins under traffic takes at most its fair share of new "
        "prefixes at first, rising to no cap over this many seconds (0: off)",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0, balance_rel_threshold >= 1")
        if min(self.eviction_interval_secs, self.max_tree_size, self.share_slack,
               self.warmup_secs) < 0:  # fmt: skip
            raise ValueError(
                "eviction_interval_secs, max_tree_size, share_slack, warmup_secs must be >= 0"
            )
        if self.cache_aware_scheduling_min_tokens < 0:
            raise ValueError("cache_aware_scheduling_min_tokens must be >= 0")

    @property
    def tree_evict_target(self) -> int:
        """What an eviction trims a worker's approximate tree to: 7/8 of max_tree_size (the
        headroom amortises a walk over the whole tree)."""
        return self.max_tree_size - self.max_tree_size // 8
