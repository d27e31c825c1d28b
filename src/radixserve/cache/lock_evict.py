"""RadixCache's locks and eviction, mixed into it: reference-counted locks that move a path's
tokens between the evictable and protected counts, and eviction of unlocked leaves in the
policy's order from the heap (``cache.evict``), removing them or, with a host tier, offloading
them. Pure Python: no torch, no I/O."""

from __future__ import annotations

from array import array

from radixserve.cache.node import TreeNode
from radixserve.cache.tokens import SLOT_CODE


class LockEvictMixin:
    """RadixCache's lock and eviction methods (state lives on RadixCache)."""

    # -- locks -------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        while not node.is_root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                if not node.children or self.host is not None:
                    self._evq.offer(node)  # (with host-only children: a device leaf too)
            node = node.parent  # type: ignore[assignment]

    # -- eviction ----------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> array:
        """Free at least ``num_tokens`` (if that many are evictable) from unlocked leaves in
        policy order; returns the freed slots, one array, for the caller to give back to the
        allocator. O(log n) per evicted leaf: the leaves wait in a heap (``cache.evict``)."""
        freed = array(SLOT_CODE)
        for run in self.evict_runs(num_tokens):
            freed += run
        return freed

    def evict_runs(self, num_tokens: int) -> list[array]:
        """``evict``, with the freed slots as one array per evicted leaf (the leaf's own, not
        copied), which an allocator frees a run at a time (``SlotAllocator.free_runs``)."""
        runs: list[array] = []
        evq, evictable = self._evq, self._evictable_leaf
        n = 0
        while n < num_tokens:
            leaf = evq.pop(evictable)
            if leaf is None:
                break
            parent = leaf.parent
            runs.append(leaf.value)  # its own array: nothing copied
            n += len(leaf.value)
            if self.host is None:
                self._remove_leaf(leaf)
            else:
                self._offload(leaf)
            if evictable(parent):
                evq.offer(parent)
        return runs

    def _evictable_leaf(self, node: TreeNode) -> bool:
        """An unlocked device node with no device child (host-only children may stay)."""
        if node.lock_ref or node.is_root:
            return False
        if not node.children:
            return node.value is not None
        return (
            node.value is not None
            and self.host is not None
            and all(c.value is None for c in node.children.values())
        )

    def _remove_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._child_key(leaf.key, 0)]
        self._evictable -= len(leaf.key)
        self._evq.drop(leaf)
        for listener in self.listeners:
            listener.on_evict(leaf)
