"""RadixCache: a token-keyed prefix tree whose values are KV slot ids.

It owns which prompt prefixes are cached, their lock counts, and the evictable / protected
accounting. Pure Python: no torch, no I/O, no clock (access order is a logical counter).

Rule for callers: lock the node a match returned (``lock(result.last_node)``) before using its
slots across a step that may evict, and unlock it exactly once when done.

Token ids must be ints in [0, 2**64) (ValueError otherwise). Speed comes from the storage:
each node's tokens are an ``array('I')`` (``array('Q')`` once an id >= 2**32 has been seen), and
a match or insert turns the caller's list into one with a single C pass (``array.fromlist``,
about as cheap as reading the list once), after which every comparison is a C compare of raw
bytes. Comparing Python lists instead costs a rich compare per token whenever the caller's ints
are not the very objects that were inserted, which is always the case for a newly tokenized
request. Slot ids live in one list per cache (the slab, see ``reset``), so the garbage collector
has no per-node list to traverse and a split copies nothing.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

from radixserve.config import CacheConfig


class TreeNode:
    """One edge of the tree: ``key`` holds its token ids as an ``array`` of unsigned ints
    (compact, compared in C, not traversed by the garbage collector); its KV slot ids are
    ``slab[lo:hi]``, a range of one list per cache that only ever grows (``value``)."""

    __slots__ = (
        "children", "parent", "key", "slab", "lo", "hi", "lock_ref", "last_access", "hits", "born"
    )  # fmt: skip

    def __init__(
        self, key: array, slab: list[int], lo: int, hi: int, parent: TreeNode | None, tick: int
    ):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.slab, self.lo, self.hi = slab, lo, hi
        self.lock_ref = 0
        self.last_access = tick
        self.hits = 0
        self.born = tick

    @property
    def value(self) -> list[int]:
        """The KV slot ids of this node's tokens, as a new list."""
        return self.slab[self.lo : self.hi]

    @property
    def is_root(self) -> bool:
        return self.parent is None or self.parent.parent is None

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock={self.lock_ref}, kids={len(self.children)})"


class MatchResult:
    """A match: ``length`` cached tokens ending at ``last_node``, and their KV ``slots``.

    ``slots`` is built on first access, from the values on the path from ``last_node`` up to the
    root: splits keep that concatenation unchanged and evicted nodes keep their values, so it is
    the list the match would have returned, and a caller that needs only the length and the node
    (the scheduler's prefix index) never pays one slot id copied per cached token."""

    __slots__ = ("_slots", "last_node", "length")

    def __init__(self, slots: list[int] | None, last_node: TreeNode, length: int) -> None:
        self._slots = slots
        self.last_node = last_node
        self.length = length

    @property
    def slots(self) -> list[int]:
        if self._slots is None:
            self._slots = path_slots(self.last_node)
        return self._slots

    @slots.setter
    def slots(self, value: list[int]) -> None:
        self._slots = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MatchResult):
            return NotImplemented
        return (self.slots, self.last_node, self.length) == (
            other.slots,
            other.last_node,
            other.length,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MatchResult(length={self.length}, last_node={self.last_node!r})"


def path_slots(node: TreeNode) -> list[int]:
    """The slots of the cached prefix that ends at ``node``, as one new list."""
    runs: list[tuple[list[int], int, int]] = []  # (slab, lo, hi), the deepest first
    while node.key:  # the root and the namespace roots have empty keys
        if runs and runs[-1][0] is node.slab and runs[-1][1] == node.hi:
            runs[-1] = (node.slab, node.lo, runs[-1][2])  # adjacent in the slab: one slice
        else:
            runs.append((node.slab, node.lo, node.hi))
        node = node.parent  # type: ignore[assignment]
    if not runs:
        return []
    slab, lo, hi = runs.pop()
    out = slab[lo:hi]
    while runs:
        slab, lo, hi = runs.pop()
        out += slab[lo:hi]
    return out


class TreeListener(Protocol):
    """Told of every structural change, so an index over the tree (the scheduler's incremental
    prefix matches) can update only what a change affects."""

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None: ...
    def on_insert(self, node: TreeNode) -> None: ...
    def on_evict(self, node: TreeNode) -> None: ...


_COMPACT_MIN = 1 << 16  # evicted slab entries worth a compaction (when also half the slab)

_ORDER = {
    "lru": lambda n: n.last_access,
    "lfu": lambda n: (n.hits, n.last_access),
    "fifo": lambda n: n.born,
}


def _common_len(key: array, query: array, start: int, end: int) -> int:
    """Length of the common prefix of ``key`` and ``query[start:end]``, for a caller that found
    they are not equal over the whole of ``key``.

    C-speed slice comparisons: one for a query that ends inside the key, then a binary search
    for where a mismatch lies that compares only the half still in doubt, so O(n) in all."""
    n = len(key)
    if end - start < n:
        n = end - start
        if query[start:end] == key[:n]:
            return n
    lo, hi = 0, n  # key[:lo] == query[start:start+lo]; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[lo:mid] == query[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    """Prefix tree over token ids; one subtree per namespace (LoRA id, cache salt, ...)."""

    def __init__(self, config: CacheConfig | None = None) -> None:
        self.config = config or CacheConfig()
        self.page_size = self.config.page_size
        if self.config.eviction_policy not in _ORDER:
            raise ValueError(f"unknown eviction policy {self.config.eviction_policy!r}")
        self._order = _ORDER[self.config.eviction_policy]
        self.listeners: list[TreeListener] = []
        self._compact_min = _COMPACT_MIN
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
        self._code, self._width = "I", 4  # 32-bit token ids until a larger one arrives
        # Every node's slots live in this one list (a node holds a range of it), so an insert
        # adds no list for the garbage collector to traverse. Ranges are never overwritten:
        # evicted ones stay until _compact() copies the live ones into a new slab, so a node
        # that left the tree (and a MatchResult that ends at it) keeps its slots.
        self._slab: list[int] = []
        self._dead = 0  # slab entries that belong to evicted nodes
        self.root = TreeNode(array("I"), self._slab, 0, 0, None, 0)
        self.root.lock_ref = 1
        self._namespaces = self.root.children  # namespace -> its root
        self._evictable = 0
        self._protected = 0
        return freed

    # -- keys ----------------------------------------------------------------------------------
    def _child_key(self, tokens: Sequence[int], start: int) -> Any:
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start : start + self.page_size])

    @property
    def key_typecode(self) -> str:
        """The ``array`` typecode of the tree's keys. Token ids handed over already in an array
        of this typecode are used as they are: no per-token conversion at all."""
        return self._code

    def _encode(self, tokens: list[int]) -> array:
        """Token ids as an array of the tree's key type, in one C pass over the list. Keys are
        32-bit until a token id >= 2**32 arrives; then every key is widened to 64 bits, once."""
        out = array(self._code)
        try:
            out.fromlist(tokens)
            return out
        except (OverflowError, TypeError):
            pass
        out = array("Q")
        try:
            out.fromlist(tokens)
        except (OverflowError, TypeError) as e:
            raise ValueError("token ids must be ints in [0, 2**64)") from e
        if self._code != "Q":
            for node in self._nodes():
                node.key = array("Q", node.key)
            self._code, self._width = "Q", 8
        return out

    def namespace_root(self, namespace: Hashable | None) -> TreeNode:
        node = self.root.children.get(namespace)
        if node is None:
            node = TreeNode(array(self._code), self._slab, 0, 0, self.root, self._tick)
            node.lock_ref = 1  # namespace roots are never evicted
            self.root.children[namespace] = node
        return node

    # -- match / insert --------------------------------------------------------------------
    def _begin(
        self, tokens: Sequence[int], namespace: Hashable | None
    ) -> tuple[Any, array | None, int, TreeNode, int]:
        """What a match or insert starts from: the ids (a list, or the caller's array when it
        is of the key type, which is then also the encoded query), the page-aligned end, the
        namespace's root, and a fresh access tick."""
        query = tokens if type(tokens) is array and tokens.typecode == self._code else None
        if query is None and type(tokens) is not list:
            tokens = list(tokens)
        end = len(tokens)
        if self.page_size != 1:
            end -= end % self.page_size
        node = self._namespaces.get(namespace) or self.namespace_root(namespace)
        self._tick = tick = self._tick + 1
        return tokens, query, end, node, tick

    def match_prefix(self, tokens: Sequence[int], namespace: Hashable | None = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages); splits a node the match ends in."""
        tokens, query, end, node, tick = self._begin(tokens, namespace)
        page = self.page_size
        if not end:
            return MatchResult(None, node, 0)
        child = node.children.get(tokens[0] if page == 1 else tuple(tokens[:page]))
        if child is None:  # a miss costs one dict lookup: the query is encoded only on a hit
            return MatchResult(None, node, 0)
        if query is None:
            query = self._encode(tokens)
        raw, width = query.tobytes(), self._width  # raw.startswith(key, offset): no slicing
        pos = 0
        while True:
            key = child.key
            n = len(key)
            if n > end - pos or not raw.startswith(key, pos * width):
                n = _common_len(key, query, pos, end)
                n -= n % page
                if n < len(key):
                    child = self._split(child, n)
            child.last_access = tick
            child.hits += 1
            pos += n
            node = child
            if pos == end:
                break
            child = node.children.get(tokens[pos] if page == 1 else tuple(tokens[pos : pos + page]))
            if child is None:
                break
        return MatchResult(None, node, pos)

    def insert(
        self, tokens: Sequence[int], slots: Sequence[int], namespace: Hashable | None = None
    ) -> int:
        """Cache ``tokens`` -> ``slots`` (whole pages); returns how many leading tokens were
        already cached, whose slots in ``slots`` the caller must free if they are its own."""
        if len(slots) < len(tokens):
            raise ValueError(f"{len(tokens)} tokens but only {len(slots)} slots")
        tokens, query, end, node, tick = self._begin(tokens, namespace)
        page = self.page_size
        if not end:
            return 0
        if query is None:
            query = self._encode(tokens)
        pos = 0
        while pos < end:
            first = tokens[pos] if page == 1 else tuple(tokens[pos : pos + page])
            child = node.children.get(first)
            if child is None:
                slab = self._slab
                lo = len(slab)
                slab += slots[pos:end]
                self._add_leaf(
                    node, first, TreeNode(query[pos:end], slab, lo, len(slab), node, tick)
                )
                break
            key = child.key
            n = len(key)
            if n > end - pos or query[pos : pos + n] != key:
                n = _common_len(key, query, pos, end)
                n -= n % page
                if n < len(key):
                    child = self._split(child, n)
            child.last_access = tick
            pos += n
            node = child
        return pos

    def _add_leaf(self, parent: TreeNode, first: Any, leaf: TreeNode) -> None:
        parent.children[first] = leaf
        self._evictable += len(leaf.key)
        for listener in self.listeners:
            listener.on_insert(leaf)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; the new upper node takes its place in the parent."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(child.key[:n], child.slab, child.lo, child.lo + n, parent, child.born)
        upper.lock_ref, upper.last_access, upper.hits = (
            child.lock_ref,
            child.last_access,
            child.hits,
        )
        child.key, child.lo, child.parent = child.key[n:], child.lo + n, upper
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
        if self._dead > self._compact_min and 2 * self._dead > len(self._slab):
            self._compact()
        return freed

    def _compact(self) -> None:
        """Copy the live nodes' slots into a new slab; the old one stays with evicted nodes."""
        slab: list[int] = []
        for node in self._nodes():
            lo = len(slab)
            slab += node.slab[node.lo : node.hi]
            node.slab, node.lo, node.hi = slab, lo, len(slab)
        self._slab, self._dead = slab, 0

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return not node.children and node.lock_ref == 0 and not node.is_root

    def _remove_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._child_key(leaf.key, 0)]
        self._evictable -= len(leaf.key)
        self._dead += leaf.hi - leaf.lo
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
        live = 0
        seen_slots: set[int] = set()
        for node in self._nodes():
            for key, child in node.children.items():
                assert child.parent is node, "child's parent pointer is wrong"
                if node is not self.root:
                    assert key == self._child_key(child.key, 0), "child keyed by the wrong page"
            if node is self.root or node.parent is self.root:
                assert not node.key and not node.value and node.lock_ref >= 1
                continue
            assert type(node.key) is array and node.key.typecode == self._code, "key not encoded"
            assert node.slab is self._slab, "node outside the live slab"
            assert 0 <= node.lo < node.hi <= len(self._slab), "slab range out of bounds"
            assert len(node.key) == node.hi - node.lo, "key/value length mismatch"
            live += node.hi - node.lo
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
        assert live + self._dead == len(self._slab), "slab entries lost or counted twice"
