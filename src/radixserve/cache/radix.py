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
request. Callers that hold their ids in an array already (``token_array``: the scheduler's
requests do, from the tokenizer on) pay no conversion at all. Each node's slot ids are its own
``array('q')`` (not a list: the garbage collector never traverses it), so an insert copies the
new suffix's slots once and an eviction hands the leaf's array to the allocator as it is.
Eviction order is a heap of the evictable leaves (``cache.evict``): O(log n) per evicted leaf.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import Any

from radixserve.cache.evict import POLICIES, EvictionHeap, add_hit
from radixserve.cache.host_room import HostRoomMixin
from radixserve.cache.host_tree import HostTreeMixin
from radixserve.cache.lock_evict import LockEvictMixin
from radixserve.cache.node import MatchResult, TreeListener, TreeNode, path_slots
from radixserve.cache.tiers import HostTier
from radixserve.cache.tokens import SLOT_CODE, common_len, token_array
from radixserve.config import CacheConfig

__all__ = ["MatchResult", "RadixCache", "TreeListener", "TreeNode", "path_slots", "token_array"]


class RadixCache(LockEvictMixin, HostTreeMixin, HostRoomMixin):
    """Prefix tree over token ids; one subtree per namespace (LoRA id, cache salt, ...).

    With a ``host`` tier, a node evicted from the device pool keeps its KV in host memory when
    it has a host copy (``cache.host_tree``): a match reports the device prefix, ``match_host``
    the host-only nodes that continue it, and ``load`` brings them back."""

    def __init__(self, config: CacheConfig | None = None, host: HostTier | None = None) -> None:
        self.config = config or CacheConfig()
        self.host = host
        self._backup_on_insert = host is not None and host.backup_hits == 1
        self._selective = host is not None and host.backup_hits == 2
        self.page_size = self.config.page_size
        name = self.config.radix_eviction_policy
        if name not in POLICIES:
            raise ValueError(f"unknown eviction policy {name!r}")
        self._policy = POLICIES[name]
        self._rekey_on_access = not self._policy.monotone  # mru: an access lowers the key
        self._benefit = name == "hit-benefit"  # only this policy pays for the decayed sums
        self.listeners: list[TreeListener] = []
        # told when a node's KV gains or loses its host copy (on_host_store / on_host_remove)
        self.host_listeners: list[Any] = []
        self.reset()

    # -- sizes -------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def reset(self) -> array:
        """Drop every entry and return the slots they held. Refused while anything is locked."""
        if getattr(self, "_protected", 0):
            raise RuntimeError("cannot reset the radix cache while requests hold locked prefixes")
        freed = array(SLOT_CODE)
        for node in self._nodes() if hasattr(self, "root") else ():
            if node.value is not None:
                freed += node.value
        if self.host is not None:
            self.host.reset()
        self._host_held = self._host_only = 0
        self._tick = 0
        self._code, self._width = "I", 4  # 32-bit token ids until a larger one arrives
        self._evq = EvictionHeap(self._policy)
        self.root = TreeNode(array("I"), array(SLOT_CODE), None, 0)
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
            node = TreeNode(array(self._code), array(SLOT_CODE), self.root, self._tick)
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
            return MatchResult(node, 0)
        child = node.children.get(tokens[0] if page == 1 else tuple(tokens[:page]))
        if child is None or child.value is None:  # a miss costs one dict lookup: the query
            return MatchResult(node, 0)  # is encoded only on a hit
        if query is None:
            query = self._encode(tokens)
        raw, width = query.tobytes(), self._width  # raw.startswith(key, offset): no slicing
        benefit, rekey = self._benefit, self._rekey_on_access
        pos = 0
        while True:
            key = child.key
            n = len(key)
            if n > end - pos or not raw.startswith(key, pos * width):
                n = common_len(key, query, pos, end)
                n -= n % page
                if n < len(key):
                    child = self._split(child, n)
            child.last_access = tick
            child.hits += 1
            if benefit:
                add_hit(child, tick)
            if rekey and child.hseq is not None:
                self._evq.rekey(child)
            pos += n
            node = child
            if pos == end:
                break
            child = node.children.get(tokens[pos] if page == 1 else tuple(tokens[pos : pos + page]))
            if child is None or child.value is None:  # the device prefix ends here
                break
        if self._selective:
            self._backup_path(node)
        return MatchResult(node, pos)

    def insert(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        namespace: Hashable | None = None,
        priority: int = 0,
    ) -> int:
        """Cache ``tokens`` -> ``slots`` (whole pages); returns how many leading tokens were
        already cached, whose slots in ``slots`` the caller must free if they are its own.
        ``priority`` (the request's) raises the priority of every node on the path."""
        return self._insert(tokens, slots, namespace, priority)[0]

    def insert_and_match(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        namespace: Hashable | None = None,
        priority: int = 0,
    ) -> MatchResult:
        """``insert``, then ``match_prefix`` of the same tokens, without walking the tree twice:
        the match's effects (a fresh access tick and a hit on each node of the path, root
        first) are made on the path the insert ends at."""
        _, node, pos = self._insert(tokens, slots, namespace, priority)
        self._tick = tick = self._tick + 1
        if not pos:
            return MatchResult(node, 0)
        path = []
        while node.key:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        benefit, rekey = self._benefit, self._rekey_on_access
        for child in reversed(path):
            child.last_access = tick
            child.hits += 1
            if benefit:
                add_hit(child, tick)
            if rekey and child.hseq is not None:
                self._evq.rekey(child)
        if self._selective:
            self._backup_path(path[0])
        return MatchResult(path[0], pos)

    def _insert(
        self, tokens: Sequence[int], slots: Sequence[int], namespace: Hashable | None, priority: int
    ) -> tuple[int, TreeNode, int]:
        """``insert``: (the tokens already cached, the node the inserted path ends at, its
        length)."""
        if len(slots) < len(tokens):
            raise ValueError(f"{len(tokens)} tokens but only {len(slots)} slots")
        tokens, query, end, node, tick = self._begin(tokens, namespace)
        page = self.page_size
        if not end:
            return 0, node, 0
        if query is None:
            query = self._encode(tokens)
        raw, width = query.tobytes(), self._width  # compared with memcmp, as in match_prefix
        pos, cached = 0, None  # cached: where the device prefix ended (a host-only node)
        while pos < end:
            first = tokens[pos] if page == 1 else tuple(tokens[pos : pos + page])
            child = node.children.get(first)
            if child is None:
                leaf = self._new_leaf(query, slots, pos, end, node, tick)
                leaf.priority = priority
                self._add_leaf(node, first, leaf)
                self._evq.offer(leaf)
                if self._backup_on_insert:
                    self._backup(leaf)
                return (pos if cached is None else cached), leaf, end
            key = child.key
            n = len(key)
            if n > end - pos or not raw.startswith(key, pos * width):
                n = common_len(key, query, pos, end)
                n -= n % page
                if n < len(key):
                    child = self._split(child, n)
            child.last_access = tick
            if priority > child.priority:
                child.priority = priority
            if self._rekey_on_access and child.hseq is not None:
                self._evq.rekey(child)
            if child.value is None:  # on the host only: the caller's fresh KV revives it
                cached = pos if cached is None else cached
                self._revive(child, slots, pos)
                self._evq.offer(child)
            pos += n
            node = child
        return (pos if cached is None else cached), node, pos

    def _new_leaf(
        self, query: array, slots: Sequence[int], pos: int, end: int, parent: TreeNode, tick: int
    ) -> TreeNode:
        if type(slots) is array and slots.typecode == SLOT_CODE:
            value = slots[pos:end]  # one C copy
        else:
            value = array(SLOT_CODE, slots[pos:end])
        return TreeNode(query[pos:end], value, parent, tick)

    def _add_leaf(self, parent: TreeNode, first: Any, leaf: TreeNode) -> None:
        parent.children[first] = leaf
        self._evictable += len(leaf.key)
        for listener in self.listeners:
            listener.on_insert(leaf)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; the new upper node takes its place in the parent."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        value, host = child.value, child.host
        upper = TreeNode(child.key[:n], None if value is None else value[:n], parent, child.born)
        upper.lock_ref, upper.last_access, upper.hits = (
            child.lock_ref,
            child.last_access,
            child.hits,
        )
        upper.priority, upper.benefit = child.priority, child.benefit
        child.key, child.parent = child.key[n:], upper
        child.value = None if value is None else value[n:]
        if host is not None:
            upper.host, child.host = host[:n], host[n:]
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        if self._benefit and value is not None:  # fewer tokens: a lower benefit, an earlier place
            self._evq.rekey(child)
        if value is not None:  # listeners follow the device tree only
            for listener in self.listeners:
                listener.on_split(upper, child)
        return upper

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
        leaves: list[TreeNode] = []  # the evictable ones, each with a live heap entry
        for node in self._nodes():
            for key, child in node.children.items():
                assert child.parent is node, "child's parent pointer is wrong"
                if node is not self.root:
                    assert key == self._child_key(child.key, 0), "child keyed by the wrong page"
            if node is self.root or node.parent is self.root:
                assert not node.key and not node.value and node.lock_ref >= 1
                continue
            assert type(node.key) is array and node.key.typecode == self._code, "key not encoded"
            assert len(node.key) % self.page_size == 0 and node.key, "node not page aligned"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock_ref"
            if node.value is None:  # host only: the host tier's check
                continue
            assert node.parent.value is not None or not node.parent.key, "device below host"
            assert type(node.value) is array and node.value.typecode == SLOT_CODE, "value type"
            assert len(node.key) == len(node.value), "key/value length mismatch"
            assert seen_slots.isdisjoint(node.value), "a slot is held by two nodes"
            seen_slots.update(node.value)
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if self._evictable_leaf(node):
                    leaves.append(node)
        assert evictable == self._evictable, f"evictable {self._evictable} != {evictable}"
        assert protected == self._protected, f"protected {self._protected} != {protected}"
        self._evq.check(leaves)
        self._check_host(self._nodes())
