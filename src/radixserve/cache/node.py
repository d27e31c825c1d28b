"""The radix tree's nodes, match results and listener protocol (RadixCache owns the tree).
Pure Python, no I/O."""

from __future__ import annotations

from array import array
from typing import Any, Protocol

from radixserve.cache.evict import BENEFIT_HALF_LIFE
from radixserve.cache.tokens import SLOT_CODE


class TreeNode:
    """One edge of the tree: ``key`` holds its token ids as an ``array`` of unsigned ints,
    ``value`` their KV slot ids as an ``array('q')`` (both compact, compared and copied in C,
    never traversed by the garbage collector). A value is never changed in place: a split
    gives both halves new arrays, so an evicted node, and a MatchResult ending at it, keep
    theirs. ``priority``, ``benefit`` and ``hseq`` serve the eviction policies; ``hseq`` is the
    entry of the one heap the node waits in (device leaves, or the host tier's leaves)."""

    __slots__ = (
        "children", "parent", "key", "value", "lock_ref", "last_access", "hits", "born",
        "priority", "benefit", "hseq", "host",
    )  # fmt: skip

    def __init__(self, key: array, value: array | None, parent: TreeNode | None, tick: int):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # None: the KV lives only in the host tier (cache.host_tree)
        self.host: array | None = None  # its host-tier slots, when it has a host copy
        self.lock_ref = 0
        self.last_access = tick
        self.hits = 0
        self.born = tick
        self.priority = 0
        self.benefit = tick / BENEFIT_HALF_LIFE  # its insertion counts as one hit
        self.hseq: int | None = None  # its live entry in the eviction heap

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

    def __init__(self, last_node: TreeNode, length: int) -> None:
        self._slots: array | None = None
        self.last_node = last_node
        self.length = length

    @property
    def slots(self) -> array:
        if self._slots is None:
            self._slots = path_slots(self.last_node)
        return self._slots

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


def path_slots(node: TreeNode) -> array:
    """The slots of the cached prefix that ends at ``node``, as one new array."""
    parts: list[array] = []  # the deepest first
    while node.key:  # the root and the namespace roots have empty keys
        parts.append(node.value)
        node = node.parent  # type: ignore[assignment]
    out = array(SLOT_CODE)
    for part in reversed(parts):
        out += part
    return out


class TreeListener(Protocol):
    """Told of every structural change, so an index over the tree (the scheduler's incremental
    prefix matches) can update only what a change affects."""

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None: ...
    def on_insert(self, node: TreeNode) -> None: ...
    def on_evict(self, node: TreeNode) -> None: ...
