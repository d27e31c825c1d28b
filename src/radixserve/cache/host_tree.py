"""The radix tree's host tier: which nodes keep a host copy, moving a node's KV between the
device pool and the host tier, and the host tier's eviction. RadixCache mixes this in.

A node is in one of three states: on the device only (``value`` set, ``host`` None), on both
(``host`` set too: backed up), or on the host only (``value`` None). The device nodes form a
prefix-closed subtree (a device node's parent is on the device), so a device match never passes
a host-only node; below a host-only node every node is host-only, and host-only nodes are never
locked. Pure Python, no I/O: every copy the bytes need is queued in ``HostTier.copies``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from radixserve.cache.node import TreeNode
from radixserve.cache.tiers import HostTier
from radixserve.cache.tokens import common_len


class HostTreeMixin:
    """Host-tier operations of RadixCache (which owns the counters they keep)."""

    host: HostTier | None
    _host_held: int  # host slots held by nodes (backed or host-only)
    _host_only: int  # tokens whose KV lives only in the host tier
    _evictable: int
    _protected: int
    _evq: Any
    listeners: list[Any]
    host_listeners: list[Any]

    def host_size(self) -> int:
        """Host slots the tree holds (host-only nodes and host copies of device nodes)."""
        return self._host_held

    def host_only_size(self) -> int:
        return self._host_only

    # -- copies to the host --------------------------------------------------------------------
    def _host_alloc(self, n: int) -> array | None:
        alloc = self.host.allocator  # type: ignore[union-attr]
        short = n - alloc.available()
        if short > 0:
            self.evict_host(short)
            if alloc.available() < n:
                return None
        return alloc.alloc(n)

    def _backup(self, node: TreeNode) -> bool:
        """Give ``node`` (on the device, not backed) a host copy; False if the host is full."""
        slots = self._host_alloc(len(node.key))
        if slots is None:
            return False
        node.host = slots
        self._host_held += len(slots)
        self.host.store(node.value, slots)  # type: ignore[union-attr]
        for listener in self.host_listeners:
            listener.on_host_store(node)
        return True

    def _backup_path(self, node: TreeNode) -> None:
        """write_through_selective: back up the matched path's nodes hit often enough."""
        need = self.host.backup_hits  # type: ignore[union-attr]
        while node.key:
            if node.host is None and node.hits + 1 >= need:  # its insertion was its first hit
                self._backup(node)
            node = node.parent  # type: ignore[assignment]

    # -- device eviction -------------------------------------------------------------------------
    def _offload(self, leaf: TreeNode) -> None:
        """``leaf`` leaves the device pool (its slots are the caller's to free): kept on the host
        if backed (write_back backs it now), else dropped with its host-only subtree."""
        host = self.host
        assert host is not None
        if leaf.host is None and host.write_back:
            self._backup(leaf)
        if leaf.host is None:
            self._drop_subtree(leaf)
            return
        n = len(leaf.key)
        self._evictable -= n
        self._evq.drop(leaf)
        for listener in self.listeners:
            listener.on_evict(leaf)  # its device copy is gone: requests there move up
        leaf.value = None
        self._host_only += n
        if not leaf.children:
            host.heap.offer(leaf)

    def _drop_subtree(self, node: TreeNode) -> None:
        """Remove ``node`` (on the device, unbacked) and every host-only node below it."""
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            stack.extend(below.children.values())
            self._forget_host(below)
        node.children.clear()
        self._remove_leaf(node)  # type: ignore[attr-defined]

    def _forget_host(self, node: TreeNode) -> None:
        host = self.host
        assert host is not None and node.host is not None and node.value is None
        for listener in self.host_listeners:
            listener.on_host_remove(node)
        host.allocator.free(node.host)
        host.heap.drop(node)
        n = len(node.host)
        self._host_held -= n
        self._host_only -= n
        node.host = None

    # -- host eviction ---------------------------------------------------------------------------
    def _host_leaf(self, node: TreeNode) -> bool:
        return node.value is None and not node.children and not node.lock_ref

    def evict_host(self, num_tokens: int) -> int:
        """Drop host-only leaves (lru) until ``num_tokens`` host slots are free again."""
        host = self.host
        if host is None:
            return 0
        n = 0
        while n < num_tokens:
            leaf = host.heap.pop(self._host_leaf)
            if leaf is None:
                break
            parent = leaf.parent
            n += len(leaf.key)
            self._forget_host(leaf)
            del parent.children[self._child_key(leaf.key, 0)]  # type: ignore[attr-defined, union-attr]
            if parent.value is None and not parent.children:  # type: ignore[union-attr]
                host.heap.offer(parent)
        return n

    # -- host hits and loads ---------------------------------------------------------------------
    def match_host(self, tokens: Sequence[int], node: TreeNode, start: int, end: int) -> list:
        """The host-only nodes that continue the device match ending at ``node`` (depth
        ``start``) along ``tokens[:end]``, top down; a node the match ends inside is split."""
        page, chain, pos = self.page_size, [], start  # type: ignore[attr-defined]
        end -= end % page
        tick = self._tick  # type: ignore[attr-defined]
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))  # type: ignore[attr-defined]
            if child is None or child.value is not None:
                break
            n = _common(child.key, tokens, pos, end)
            n -= n % page
            if not n:
                break
            if n < len(child.key):
                child = self._split(child, n)  # type: ignore[attr-defined]
            child.last_access = tick
            chain.append(child)
            pos += n
            node = child
        return chain

    def pin_host(self, chain: list[TreeNode], delta: int) -> None:
        """Keep ``chain`` (from ``match_host``) from host eviction while its load is prepared
        (``delta`` 1), or let it go again (-1)."""
        for node in chain:
            node.lock_ref += delta
            if not node.lock_ref and not node.children:
                self.host.heap.offer(node)  # type: ignore[union-attr]

    def load(self, chain: list[TreeNode], slots: array) -> None:
        """Bring ``chain`` (pinned) back to the device at ``slots``: one load copy per node. The
        caller's lock on the node above ``chain`` and the pins are now one lock on ``chain[-1]``
        (the caller unlocks ``chain[-1]`` once when done)."""
        host = self.host
        assert host is not None
        pos = 0
        for node in chain:
            n = len(node.key)
            node.value = slots[pos : pos + n]
            pos += n
            host.heap.drop(node)
            host.load(node.host, node.value)  # type: ignore[arg-type]
            self._host_only -= n
            self._protected += n
            for listener in self.listeners:
                listener.on_insert(node)

    def _revive(self, node: TreeNode, slots: Sequence[int], pos: int) -> None:
        """An insert passes host-only ``node`` with freshly computed KV: take the caller's
        slots, so the node is on the device again (its host copy stays)."""
        n = len(node.key)
        value = slots[pos : pos + n]
        node.value = value if type(value) is array else array("q", value)
        self.host.heap.drop(node)  # type: ignore[union-attr]
        self._host_only -= n
        self._evictable += n
        for listener in self.listeners:
            listener.on_insert(node)

    # -- pages from a lower tier (the storage tier's prefetch) ------------------------------------
    def cached_len(
        self,
        tokens: Sequence[int],
        namespace: Any = None,
        start: tuple[TreeNode, int] | None = None,
    ) -> int:
        """Leading tokens of ``tokens`` (whole pages) held in either tier; read only: no split,
        no access recorded (the storage tier asks this before it looks further). ``start``: a
        node that ``tokens`` reach whole, and its depth (a match just made), to walk on from."""
        page = self.page_size  # type: ignore[attr-defined]
        end = len(tokens) - len(tokens) % page
        node, pos = start or (self.root.children.get(namespace), 0)  # type: ignore[attr-defined]
        while node is not None and pos < end:
            child = node.children.get(self._child_key(tokens, pos))  # type: ignore[attr-defined]
            if child is None:
                break
            n = _common(child.key, tokens, pos, end)
            pos += n - n % page
            if n < len(child.key):
                break
            node = child
        return pos

    def device_prefix(self, tokens: Sequence[int], namespace: Any = None) -> tuple[TreeNode, int]:
        """The longest prefix of ``tokens`` (whole pages) whose KV is in the device pool, as
        (its last node, its length); read only, like ``cached_len``. The node's key may go on
        past the prefix: ``path_slots(node)[:length]`` are the prefix's slots, and locking the
        node keeps them (a reader outside the scheduler: the storage tier's writer)."""
        page = self.page_size  # type: ignore[attr-defined]
        end = len(tokens) - len(tokens) % page
        node = self.root.children.get(namespace)  # type: ignore[attr-defined]
        if node is None:
            return self.root, 0  # type: ignore[attr-defined]
        pos = 0
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))  # type: ignore[attr-defined]
            if child is None or child.value is None:
                break
            n = _common(child.key, tokens, pos, end)
            n -= n % page
            if not n:
                break
            pos += n
            node = child
            if n < len(child.key):
                break
        return node, pos

    def alloc_host(self, n: int) -> array | None:
        """``n`` host slots (whole pages), evicting host-only leaves for them; None if the host
        tier cannot make that many free."""
        if self.host is None or n % self.page_size:  # type: ignore[attr-defined]
            return None
        return self._host_alloc(n)

    def free_host(self, slots: array) -> None:
        """Give back host slots from ``alloc_host`` that no node took."""
        if len(slots):
            self.host.allocator.free(slots)  # type: ignore[union-attr]

    def insert_host(
        self, tokens: Sequence[int], slots: array, namespace: Any = None, start: int = 0
    ) -> int:
        """Cache ``tokens[start:]`` (whole pages), whose KV the caller has written at host
        ``slots`` (one per position from ``start``), as host-only nodes below what either tier
        holds. ``tokens[:start]`` must be held already (else nothing is inserted); the slots
        of positions held already, or not inserted, are freed. Returns the tokens gained."""
        page = self.page_size  # type: ignore[attr-defined]
        end = len(tokens) - len(tokens) % page
        if len(slots) != end - start or start % page:
            raise ValueError(f"positions {start}..{end} but {len(slots)} host slots")
        tokens = list(tokens[:end])
        root = self._namespaces.get(namespace) or self.namespace_root(namespace)  # type: ignore[attr-defined]
        node, pos = root, 0
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))  # type: ignore[attr-defined]
            if child is None:
                break
            n = _common(child.key, tokens, pos, end)
            n -= n % page
            if n < len(child.key):
                child = self._split(child, n)  # type: ignore[attr-defined]
            pos += n
            node = child
        if pos < start or pos == end:
            self.free_host(slots)
            return 0
        self.free_host(slots[: pos - start])
        leaf = TreeNode(self._encode(tokens[pos:end]), None, node, self._tick)  # type: ignore[attr-defined]
        leaf.host = slots[pos - start :]
        node.children[self._child_key(tokens, pos)] = leaf  # type: ignore[attr-defined]
        n = end - pos
        self._host_held += n
        self._host_only += n
        self.host.heap.offer(leaf)  # type: ignore[union-attr]
        for listener in self.host_listeners:
            listener.on_host_store(leaf)
        return n

    # -- integrity -------------------------------------------------------------------------------
    def _check_host(self, nodes: list[TreeNode]) -> None:
        held = only = 0
        seen: set[int] = set()
        leaves = []
        for node in nodes:
            if node.host is None:
                assert node.value is not None or not node.key, "a node in no tier"
                continue
            assert len(node.host) == len(node.key), "host copy length mismatch"
            assert seen.isdisjoint(node.host), "a host slot is held by two nodes"
            seen.update(node.host)
            held += len(node.host)
            if node.value is None:
                only += len(node.key)
                assert node.lock_ref == 0, "a host-only node is locked"
                assert all(c.value is None for c in node.children.values()), "device below host"
                if not node.children:
                    leaves.append(node)
        assert held == self._host_held, f"host held {self._host_held} != {held}"
        assert only == self._host_only, f"host only {self._host_only} != {only}"
        if self.host is not None:
            alloc = self.host.allocator
            assert alloc.available() + held == alloc.total, "host slots leak"
            self.host.heap.check(leaves)


def _common(key: array, tokens: Sequence[int], pos: int, end: int) -> int:
    """How many of ``key``'s tokens equal ``tokens[pos:end]``'s, from the start."""
    n = min(len(key), end - pos)
    if type(tokens) is array and tokens.typecode == key.typecode:  # compared in C
        return n if key[:n] == tokens[pos : pos + n] else common_len(key, tokens, pos, pos + n)
    if key[:n].tolist() == list(tokens[pos : pos + n]):
        return n
    return next(i for i, (a, b) in enumerate(zip(key, tokens[pos : pos + n])) if a != b)
