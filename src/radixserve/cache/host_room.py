"""Room in the host tier for pages that come from below it (the storage tier's prefetch): how
much a landing can have, and making it. RadixCache mixes this in; pure Python, no I/O.

Under write-through the host tier holds a copy of every device page, so a host tier little
larger than the device pool has almost no free slot and no host-only leaf to evict: a prefetch
would be read and then find nowhere to land. But a host copy of a page the device also holds
is only a spare: dropping it loses nothing now (the device still has the KV). A landing takes,
in this order: free slots, spare copies (most recently used device nodes first: the device
evicts them last, so their copies are the ones least likely to be needed soon), then host-only
leaves (lru). A spare copy is never dropped while a host-only node hangs below its node (the
device evicting an unbacked node drops its host-only subtree, ``_offload``), nor while a page
copy to or from its slots is pending (the landing writes its bytes now, before those copies
run).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from radixserve.cache.host_tree import _common
from radixserve.cache.node import TreeNode
from radixserve.cache.tiers import HostTier


class HostRoomMixin:
    """Host room for landings, on RadixCache's host tier and counters."""

    host: HostTier | None
    _host_held: int
    _host_only: int
    host_listeners: list[Any]

    def host_room(self, want: int) -> int:
        """Host slots a landing of ``want`` could have now, at most ``want``: free ones,
        host-only ones and spare copies (the last are counted only when needed)."""
        host = self.host
        if host is None or want <= 0:
            return 0
        room = host.allocator.available() + self._host_only
        if room < want:
            room += sum(len(node.host) for node in self._spare_copies())  # type: ignore[misc]
        return min(room, want)

    def land_slots(
        self, tokens: Sequence[int], start: int, end: int, unit: int, namespace: Any = None
    ) -> array:
        """Host slots for positions ``start..end`` of ``tokens`` (whole ``unit``s, each whole
        pages), or for as many leading units of them as room can be made for (maybe none);
        the host-only nodes of ``tokens[:start]`` are kept, so the pages still have a place
        to hang (``insert_host``). Free them with ``free_host`` if no node takes them."""
        if self.host is None or (end - start) % unit or unit % self.page_size:  # type: ignore[attr-defined]
            return array("q")
        alloc = self.host.allocator
        room = self.host_room(end - start)
        want = room - room % unit  # nothing is dropped for a unit that would not fit
        if alloc.available() < want:
            self._drop_spare_copies(want - alloc.available())
        if alloc.available() < want:
            keep = self._host_path(tokens, start, namespace)
            self.pin_host(keep, 1)  # type: ignore[attr-defined]
            self.evict_host(want - alloc.available())  # type: ignore[attr-defined]
            self.pin_host(keep, -1)  # type: ignore[attr-defined]
        n = min(want, alloc.available())
        n -= n % unit
        return alloc.alloc(n) if n else array("q")

    def _spare_copies(self) -> list[TreeNode]:
        """Device nodes whose host copy may be dropped, the most recently used first."""
        busy = {slot for copy in self.host.copies for slot in copy.host}  # type: ignore[union-attr]
        nodes = self._nodes()  # type: ignore[attr-defined]
        above_host_only: set[int] = set()  # ids of the nodes with a host-only node below
        for node in nodes:
            if node.value is None and node.host is not None:
                up = node.parent
                while up is not None and id(up) not in above_host_only:
                    above_host_only.add(id(up))
                    up = up.parent
        spare = [
            node
            for node in nodes
            if node.value is not None
            and node.host is not None
            and id(node) not in above_host_only
            and busy.isdisjoint(node.host)
        ]
        spare.sort(key=lambda node: node.last_access, reverse=True)
        return spare

    def _drop_spare_copies(self, num_tokens: int) -> int:
        """Drop spare host copies until ``num_tokens`` host slots are freed (or none is left)."""
        freed = 0
        for node in self._spare_copies():
            if freed >= num_tokens:
                break
            freed += len(node.host)  # type: ignore[arg-type]
            for listener in self.host_listeners:
                listener.on_host_remove(node)
            self.host.allocator.free(node.host)  # type: ignore[union-attr, arg-type]
            self._host_held -= len(node.host)  # type: ignore[arg-type]
            node.host = None
        return freed

    def _host_path(self, tokens: Sequence[int], end: int, namespace: Any) -> list[TreeNode]:
        """The host-only nodes on the path of ``tokens[:end]`` (read only: nothing split)."""
        node = self.root.children.get(namespace)  # type: ignore[attr-defined]
        out, pos = [], 0
        while node is not None and pos < end:
            child = node.children.get(self._child_key(tokens, pos))  # type: ignore[attr-defined]
            if child is None:
                break
            if child.value is None:
                out.append(child)
            n = _common(child.key, tokens, pos, end)
            if n < len(child.key):
                break
            pos += n
            node = child
        return out
