"""The host tier as the cache knows it: host slot allocation, the write policy, the host-only
leaves in eviction order, and the ordered list of page copies the tree's changes call for.

Pure Python, no torch, no I/O: the bytes move in ``kvstore`` (driven by the scheduler process),
which applies ``take_copies()`` in order before the forward that may overwrite a device slot.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from radixserve.cache.evict import POLICIES, EvictionHeap
from radixserve.cache.pool import SlotAllocator

# SGLang's --hicache-write-policy values and the hit count at which a device node is copied to
# the host tier (write_back copies nothing until the node leaves the device pool):
#   write_through            every node, as soon as it is cached (its insertion is its first hit)
#   write_through_selective  a node once it is hit a second time (a prefix worth keeping)
#   write_back               a node when it is evicted from the device pool, if host room allows
WRITE_POLICIES: dict[str, int | None] = {
    "write_through": 1,
    "write_through_selective": 2,
    "write_back": None,
}
HOST_SEQ_BASE = 1 << 60  # host-heap entry ids: never equal to a device-heap id of the same node


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy KV between tiers: ``store`` device -> host, ``load`` host -> device; ``device[i]``
    and ``host[i]`` are the two slots of one token."""

    kind: str  # "store" | "load"
    device: array
    host: array


class HostTier:
    """Host slots (whole pages, like the device pool's), the write policy, the host-only leaves
    (lru order) and the copies pending since the last ``take_copies``."""

    def __init__(self, num_tokens: int, page_size: int, write_policy: str) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"unknown hicache write policy {write_policy!r}; choose from {sorted(WRITE_POLICIES)}"
            )
        self.allocator = SlotAllocator(num_tokens, page_size)
        self.write_policy = write_policy
        self.backup_hits = WRITE_POLICIES[write_policy]
        self.write_back = write_policy == "write_back"
        self.heap = EvictionHeap(POLICIES["lru"])
        self.heap._seq = HOST_SEQ_BASE
        self.copies: list[PageCopy] = []
        self.stored = self.loaded = 0  # tokens copied each way, ever

    @property
    def total(self) -> int:
        return self.allocator.total

    def store(self, device: array, host: array) -> None:
        self.copies.append(PageCopy("store", device, host))
        self.stored += len(host)

    def load(self, host: array, device: array) -> None:
        self.copies.append(PageCopy("load", device, host))
        self.loaded += len(host)

    def take_copies(self) -> list[PageCopy]:
        """The copies queued so far, in order; the caller applies them before the next forward."""
        out, self.copies = self.copies, []
        return out

    def reset(self) -> None:
        self.allocator.reset()
        self.heap = EvictionHeap(POLICIES["lru"])
        self.heap._seq = HOST_SEQ_BASE
        self.copies = []
