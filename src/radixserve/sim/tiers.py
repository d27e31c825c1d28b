"""The simulated fleet's lower KV tiers: the settings (`radixserve sim --kv-store-gb ...`), the
fleet-wide KV store (whole blocks under chained keys, LRU, bounded), and the per-request
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
# Keys chain the blocks (a block's key depends on every token before it), so a hit is always a
# prefix. Eviction is LRU by block; a hit or write touches a chain's blocks last to first, so a
# chain is evicted from its end.

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat, takewhile

from radixserve.config import check_fields
from radixserve.sim.costmodel import CostModel, TierSpec

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


class SimStore:
    """Whole blocks of KV under chained keys, least recently used evicted first."""

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block = block_tokens
        self.capacity = capacity_tokens // block_tokens  # in blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.written = self.evicted = self.read = 0  # blocks, ever

    def __len__(self) -> int:
        return len(self._lru)

    def keys(
        self, tokens: Sequence[int], head: Sequence[int] = (), more: Sequence[int] = ()
    ) -> list[int]:
        """Chained keys of the whole blocks of ``tokens`` followed by ``more``; ``head``: keys
        already computed for the first blocks (a prompt's, when its reply is appended: only
        the tokens past them are read, so the prompt is not copied)."""
        b, out = self.block, list(head)
        prev = out[-1] if out else 0
        skip = len(out) * b
        rest = [*tokens[skip:], *more[max(0, skip - len(tokens)) :]]
        del rest[len(rest) - len(rest) % b :]
        # the blocks as tuples, cut in C (zip of one iterator b times); a key is the hash of
        # (the previous key, the block), as a tuple of the block's ints would hash
        for block in zip(*[iter(rest)] * b):
            prev = hash((prev, block))
            out.append(prev)
        return out

    def leading(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, the store holds."""
        return len(list(takewhile(self._lru.__contains__, keys)))

    def read_blocks(self, keys: Sequence[int]) -> None:
        """A get of ``keys`` (held when it started): those still held become the most
        recently used (one evicted meanwhile was read before it went)."""
        self.read += len(keys)
        lru = self._lru
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)

    def write(self, keys: Sequence[int]) -> None:
        """Put ``keys``' blocks (those already held are only touched), then evict to capacity."""
        lru = self._lru
        self.written += self._touch(keys)
        over = len(lru) - self.capacity
        if over > 0:  # the least recently used go, popped in C
            deque(map(lru.popitem, repeat(False, over)), maxlen=0)
            self.evicted += over

    def _touch(self, keys: Sequence[int]) -> int:
        """Make ``keys`` the most recently used, adding those not held; returns how many were
        added (chained keys are distinct, so none is counted twice)."""
        lru, held, move = self._lru, len(self._lru), self._lru.move_to_end
        for k in reversed(keys):  # the chain's first block ends most recent: evicted last
            if k in lru:
                move(k)
            else:
                lru[k] = None
        return len(lru) - held

    def check(self) -> None:
        """The store never holds more than its capacity; every block read was written."""
        assert len(self._lru) <= self.capacity, f"store holds {len(self._lru)} > {self.capacity}"
        assert self.written - self.evicted == len(self._lru), "store block count drifted"


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
