"""The simulated fleet's lower KV tiers: the settings (`radixserve sim --kv-store-gb ...`), the
fleet-wide KV store (``SimStore``, in sim/block_store.py), and the per-request
account of which tier each cached token came from.

The host tier itself is the engines' own (the real scheduler's HiCache tier, enabled with
``--enable-hierarchical-cache``); only its copy bandwidth is set here."""

# How a request meets the tiers in the simulator (sim/cluster.py drives it):
#   device  its engine's radix cache matches the prompt: no cost.
#   host    the engine's host tier continues the match: the scheduler loads those pages back
#           before the forward that needs them (Batch.kv_copies); the step takes longer by
#           tokens x KV bytes per token / host bandwidth.
#   store   the store holds more of the prompt than device and host together: at dispatch the
#           engine starts one batched get of the missing blocks over its NIC (one get at a time
#           per engine, so concurrent loads queue: store latency + bytes / store bandwidth, then
#           the host -> device copy of everything below the device match); the request joins
#           the engine's queue when it lands, with those pages in the engine's tree. The wait
#           is in its TTFT; a request waiting for its load never holds up the others.
#           Admission looks again: a waiting request the next step may admit whose prefix was
#           evicted from device and host meanwhile (a small pool, a long queue) gets the
#           store's blocks loaded the same way before that step, which waits for them.
#   miss    the rest is computed.
# The store is written through: a request's prompt blocks once its prefill is done, its whole
# sequence (chat history) once it finishes; writes are off the critical path (no time charged).
# A block is known by every token up to its end (as chained keys know it), so a hit is always a
# prefix. Eviction is LRU by block; a hit or write touches a chain's blocks last to first, so a
# chain is evicted from its end.

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.config import check_fields
from radixserve.sim.block_store import SimStore
from radixserve.sim.costmodel import CostModel, TierSpec

__all__ = ["TIERS", "Landing", "SimStore", "SimTierConfig", "gb_for_tokens", "split_by_tier"]

TIERS = ("device", "host", "store", "miss")


def _f(default: object, help: str, **kw: object) -> object:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class SimTierConfig:
    """The simulated lower tiers; unset bandwidths and latency are the preset's."""

    kv_store_gb: float = _f(
        0.0, "fleet-wide KV store (Mooncake Store) size in GB of KV; 0: no store tier", ge=0
    )
    host_bandwidth_gbs: float | None = _f(
        None, "host tier <-> device copy bandwidth per engine, GB/s (default: the preset's)", gt=0
    )
    store_bandwidth_gbs: float | None = _f(
        None, "store -> engine bandwidth per engine, GB/s (default: the preset's)", gt=0
    )
    store_latency_ms: float | None = _f(
        None, "latency of one batched get from the store, ms (default: the preset's)", ge=0
    )
    store_block_tokens: int = _f(16, "tokens per store block (keys are per block)", ge=1)
    tier_aware: bool = _f(
        True, "kv_aware scores store hits at their load cost (issue 28); off: device only"
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def spec(self, cost: CostModel) -> TierSpec:
        """The preset's tiers with this config's overrides."""
        base = cost.tier_spec()
        return TierSpec(
            base.host_memory_bytes,
            base.host_bandwidth
            if self.host_bandwidth_gbs is None
            else self.host_bandwidth_gbs * 1e9,
            base.store_bandwidth
            if self.store_bandwidth_gbs is None
            else self.store_bandwidth_gbs * 1e9,
            base.store_latency_s if self.store_latency_ms is None else self.store_latency_ms / 1e3,
            base.transfer_bandwidth,
        )

    def store_tokens(self, cost: CostModel) -> int:
        """The store's size in tokens of the model's whole KV (every tensor-parallel rank's)."""
        return int(self.kv_store_gb * 1e9 // cost.model.kv_bytes_per_token)


def gb_for_tokens(tokens: int, cost: CostModel) -> float:
    """GB of store holding ``tokens`` of the model's KV (``--kv-store-gb`` for a working set)."""
    return tokens * cost.model.kv_bytes_per_token / 1e9


@dataclass(slots=True)
class Landing:
    """A request's prefix loaded below its engine's device match: ``start`` (the device match
    when it landed), then ``host`` tokens revived from the engine's host tier, then ``store``
    tokens from the store."""

    start: int = 0
    host: int = 0
    store: int = 0


def split_by_tier(cached: int, host_loaded: int, landing: Landing | None) -> dict[str, int]:
    """A finished request's cached tokens by tier. ``cached``: the scheduler's (its device
    prefix at admission, with the pages loaded for it); ``host_loaded``: of those, what the
    scheduler itself loaded from the host tier (they follow the device prefix)."""
    device = cached - host_loaded  # the prefix the request found on the device at admission
    host = host_loaded
    store = 0
    if landing is not None:
        top = landing.start + landing.host
        store = max(0, min(device, top + landing.store) - top)
        revived = max(0, min(device, top) - landing.start)
        host += revived
        device -= store + revived
    return {"device": device, "host": host, "store": store}


def deepest_tier(split: dict[str, int]) -> str:
    """The lowest tier a request's cached prefix reached (``miss``: nothing cached)."""
    for tier in ("store", "host", "device"):
        if split[tier]:
            return tier
    return "miss"
