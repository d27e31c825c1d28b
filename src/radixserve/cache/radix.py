"""RadixCache: a token-keyed prefix tree whose values are KV slot ids.

It owns which prompt prefixes are cached, their lock counts, and the evictable / protected
accounting. Pure Python: no torch, no I/O, no clock (access order is a logical counter).

Rule for callers: lock the node a match returned (``lock(result.last_node)``) before using its
slots across a step that may evict, and unlock it exactly once when done.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.config import CacheConfig


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "hits", "born")

    def __init__(self, key: list[int], value: list[int], parent: TreeNode | None, tick: int):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = tick
        self.hits = 0
        self.born = tick

    @property
    def is_root(self) -> bool:
        return self.parent is None or self.parent.parent is None

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock={self.lock_ref}, kids={len(self.children)})"


@dataclass(slots=True)
class MatchResult:
    slots: list[int]
    last_node: TreeNode
    length: int


class TreeListener(Protocol):
    """Told of every structural change, so an index over the tree (the scheduler's incremental
    prefix matches) can update only what a change affects."""

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None: ...
    def on_insert(self, node: TreeNode) -> None: ...
    def on_evict(self, node: TreeNode) -> None: ...


_ORDER = {
    "lru": lambda n: n.last_access,
    "lfu": lambda n: (n.hits, n.last_access),
    "fifo": lambda n: n.born,
}


def _common_len(key: list[int], tokens: list[int], start: int, end: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[start:end]``.

    C-speed list comparisons, far faster in CPython than a token-by-token loop: one for a
    whole-node match (the common case), then a binary search for where a mismatch lies that
    compares only the half still in doubt, so O(n) in all rather than O(n log n)."""
    n = min(len(key), end - start)
    window = tokens[start : start + n]
    if (key if n == len(key) else key[:n]) == window:
        return n
    lo, hi = 0, n  # key[:lo] == window[:lo]; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[lo:mid] == window[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _as_list(seq: Sequence[int]) -> list[int]:
    return seq if type(seq) is list else list(seq)


class RadixCache:
    """Prefix tree over token ids; one subtree per namespace (LoRA id, cache salt, ...)."""

    def __init__(self, config: CacheConfig | None = None) -> None:
        self.config = config or CacheConfig()
        self.page_size = self.config.page_size
        if self.config.eviction_policy not in _ORDER:
            raise ValueError(f"unknown eviction policy {self.config.eviction_policy!r}")
        self._order = _ORDER[self.config.eviction_policy]
        self.listeners: list[TreeListener] = []
        self.reset()

    # -- sizes -------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def reset(self) -> list[int]:
        """Drop every entry and return the slots they held. Refused while anything is locked."""
        if getattr(self, "_protected", 0):
            raise RuntimeError("cannot reset the radix cache while requests hold locked prefixes")
        freed = [s for node in self._nodes() for s in node.value] if hasattr(self, "root") else []
        self._tick = 0
        self.root = TreeNode([], [], None, 0)
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        return freed

    # -- keys ----------------------------------------------------------------------------------
    def _child_key(self, tokens: Sequence[int], start: int) -> Any:
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start : start + self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def namespace_root(self, namespace: Hashable | None) -> TreeNode:
        node = self.root.children.get(namespace)
        if node is None:
            node = TreeNode([], [], self.root, self._tick)
            node.lock_ref = 1  # namespace roots are never evicted
            self.root.children[namespace] = node
        return node

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # -- match / insert --------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], namespace: Hashable | None = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages); splits a node the match ends in."""
        tokens = _as_list(tokens)  # keys are lists, and a list never equals a tuple or array
        end = self._aligned(len(tokens))
        node = self.namespace_root(namespace)
        slots: list[int] = []
        tick = self._next_tick()
        pos = 0
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            n = self._aligned(_common_len(child.key, tokens, pos, end))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            child.hits += 1
            slots += child.value
            pos += n
            node = child
        return MatchResult(slots, node, pos)

    def insert(
        self, tokens: Sequence[int], slots: Sequence[int], namespace: Hashable | None = None
    ) -> int:
        """Cache ``tokens`` -> ``slots`` (whole pages); returns how many leading tokens were
        already cached, whose slots in ``slots`` the caller must free if they are its own."""
        if len(slots) < len(tokens):
            raise ValueError(f"{len(tokens)} tokens but only {len(slots)} slots")
        tokens = _as_list(tokens)
        end = self._aligned(len(tokens))
        node = self.namespace_root(namespace)
        tick = self._next_tick()
        pos = 0
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                self._add_leaf(node, tokens[pos:end], _as_list(slots[pos:end]), tick)
                break
            n = self._aligned(_common_len(child.key, tokens, pos, end))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            pos += n
            node = child
        return min(pos, end)

    def _add_leaf(self, parent: TreeNode, key: list[int], value: list[int], tick: int) -> None:
        leaf = TreeNode(key, value, parent, tick)
        parent.children[self._child_key(key, 0)] = leaf
        self._evictable += len(key)
        for listener in self.listeners:
            listener.on_insert(leaf)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; the new upper node takes its place in the parent."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(child.key[:n], child.value[:n], parent, child.born)
        upper.lock_ref, upper.last_access, upper.hits = (
            child.lock_ref,
            child.last_access,
            child.hits,
        )
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        for listener in self.listeners:
            listener.on_split(upper, child)
        return upper

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
            node = node.parent  # type: ignore[assignment]

    # -- eviction ----------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> list[int]:
        """Free at least ``num_tokens`` (if that many are evictable) from unlocked leaves in
        policy order; returns the freed slots for the caller to give back to the allocator."""
        order = self._order
        heap = [(order(n), id(n), n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self._remove_leaf(leaf)
            freed += leaf.value
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (order(parent), id(parent), parent))
        return freed

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return not node.children and node.lock_ref == 0 and not node.is_root

    def _remove_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._child_key(leaf.key, 0)]
        self._evictable -= len(leaf.key)
        for listener in self.listeners:
            listener.on_evict(leaf)

    # -- inspection --------------------------------------------------------------------------
    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        """Recount every running counter and check every structural invariant."""
        evictable = protected = 0
        seen_slots: set[int] = set()
        for node in self._nodes():
            for key, child in node.children.items():
                assert child.parent is node, "child's parent pointer is wrong"
                if node is not self.root:
                    assert key == self._child_key(child.key, 0), "child keyed by the wrong page"
            if node is self.root or node.parent is self.root:
                assert not node.key and not node.value and node.lock_ref >= 1
                continue
            assert node.key and len(node.key) == len(node.value), "key/value length mismatch"
            assert len(node.key) % self.page_size == 0, "node not page aligned"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock_ref"
            assert seen_slots.isdisjoint(node.value), "a slot is held by two nodes"
            seen_slots.update(node.value)
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self._evictable, f"evictable {self._evictable} != {evictable}"
        assert protected == self._protected, f"protected {self._protected} != {protected}"
