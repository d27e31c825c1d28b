"""Approximate multi-tenant radix tree: which prefixes the router believes each worker caches.
Owns insert, per-tenant prefix match, O(1) per-tenant sizes, per-tenant LRU eviction, integrity."""

# Design (why it looks like this):
# - Keys are packed bytes in 8-byte units (tree_keys.py): edges are `bytes` slices, so matching an
#   edge is one C-level compare, and a node costs its edge plus about 450 bytes (node, tenant
#   dict, parent's index entry), not one object per character as in a character trie.
# - The tree is compressed (one node per branch point) and shared by all tenants: a node records
#   which tenants hold it, when each last touched it and how often. Holding is prefix-closed: a
#   tenant that holds a node holds every ancestor, so the tenants of the deepest matched node are
#   exactly the tenants with the longest match.
# - One subtree per namespace (key kind, model, LoRA adapter, cache salt), so requests that an
#   engine would not serve from the same KV cache never share a node.
# - Sizes (key units held) and node counts are running per-tenant counters; `check_integrity()`
#   recounts them. Eviction caps a tenant's cost, its size plus `node_units` per node held, so
#   that the cap bounds memory even when edges are short (a node costs ~475 bytes beside its
#   edge). Sizes alone stay the placement signal: they measure distinct content, where node
#   counts mostly measure how many requests came. Eviction removes a tenant from its least
#   recently used leaves until it fits; a node nobody holds goes.
# - Nothing here reads a clock: callers pass `now`, so a simulator can drive it on virtual time.

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator

from radixserve.router.policies.tree_keys import UNIT, Namespace

Tenant = Hashable
NODE_UNITS = 60
"""What a node costs beside its edge, in units: ~475 bytes measured (node, tenant dict and its
entry, the parent's index key and slot)."""
_Use = tuple[float, int]
"""(last access, inserts through the node): LRU order, and which holder a prefix calls home."""
Match = tuple[int, int, float]
"""(matched units, inserts through the deepest matched node, its last access)."""
_HeapItem = tuple[float, int, "_Node"]
_Held = dict[tuple["_Node", Tenant], int]


class _Node:
    __slots__ = ("edge", "parent", "children", "tenants")

    def __init__(self, edge: bytes, parent: _Node | None, tenants: dict[Tenant, _Use]) -> None:
        self.edge = edge
        self.parent = parent
        # Leaves are the majority of nodes, so they carry no empty dict.
        self.children: dict[bytes, _Node] | None = None
        self.tenants = tenants


def _common_bytes(key: bytes, pos: int, edge: bytes) -> int:
    """Bytes of `edge` that `key[pos:]` matches, in whole units; the first unit is known equal."""
    lo, hi = 1, min(len(edge), len(key) - pos) // UNIT
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key[pos : pos + mid * UNIT] == edge[: mid * UNIT]:
            lo = mid
        else:
            hi = mid - 1
    return lo * UNIT


def _descend(node: _Node, key: bytes, pos: int) -> tuple[_Node | None, int]:
    """The child of `node` on the path of `key[pos:]`, and how many of its edge bytes match."""
    if not node.children:
        return None, 0
    child = node.children.get(key[pos : pos + UNIT])
    if child is None:
        return None, 0
    edge = child.edge
    if key[pos : pos + len(edge)] == edge:
        return child, len(edge)
    return child, _common_bytes(key, pos, edge)


def _check_key(key: bytes) -> None:
    if len(key) % UNIT:
        raise ValueError(f"key length {len(key)} is not a multiple of {UNIT} bytes")


def _check(cond: bool, msg: str) -> None:
    # Not `assert`: integrity checks must also run under `python -O`.
    if not cond:
        raise AssertionError(msg)


class MultiTenantTree:
    """Radix tree of packed keys shared by tenants (workers); lengths and sizes are in units."""

    def __init__(self, node_units: int = 0) -> None:
        self.node_units = node_units
        self._roots: dict[Namespace, _Node] = {}
        self._sizes: dict[Tenant, int] = {}
        self._nodes: dict[Tenant, int] = {}
        self._seq = itertools.count()

    # ----- reads (never mutate: a policy's select() may call them freely) -----

    def prefix_match(self, key: bytes, ns: Namespace = ()) -> tuple[int, list[Tenant]]:
        """Longest matched length and the tenants that hold it (none when nothing matches)."""
        _check_key(key)
        node, pos, deepest = self._roots.get(ns), 0, None
        while node is not None and pos < len(key):
            child, n = _descend(node, key, pos)
            if child is None:
                break
            pos, deepest = pos + n, child
            node = child if n == len(child.edge) else None
        return pos // UNIT, list(deepest.tenants) if deepest else []

    def prefix_match_tenant(self, key: bytes, tenant: Tenant, ns: Namespace = ()) -> int:
        """Length of the longest prefix of `key` that `tenant` holds."""
        _check_key(key)
        node, pos = self._roots.get(ns), 0
        while node is not None and pos < len(key):
            child, n = _descend(node, key, pos)
            if child is None or tenant not in child.tenants:
                break
            pos += n
            node = child if n == len(child.edge) else None
        return pos // UNIT

    def tenant_matches(self, key: bytes, ns: Namespace = ()) -> dict[Tenant, Match]:
        """For every tenant with a match: (matched length, inserts through and last access of
        its deepest matched node)."""
        _check_key(key)
        out: dict[Tenant, Match] = {}
        node, pos = self._roots.get(ns), 0
        while node is not None and pos < len(key):
            child, n = _descend(node, key, pos)
            if child is None:
                break
            pos += n
            matched = pos // UNIT
            for tenant, (stamp, hits) in child.tenants.items():
                out[tenant] = (matched, hits, stamp)
            node = child if n == len(child.edge) else None
        return out

    def size(self, tenant: Tenant) -> int:
        """Units held by `tenant` (O(1))."""
        return self._sizes.get(tenant, 0)

    def sizes(self) -> dict[Tenant, int]:
        """Units held per known tenant."""
        return dict(self._sizes)

    def cost(self, tenant: Tenant) -> int:
        """What eviction caps: `tenant`'s size plus `node_units` per node it holds (O(1))."""
        return self._sizes.get(tenant, 0) + self.node_units * self._nodes.get(tenant, 0)

    # ----- writes -----

    def insert(self, key: bytes, tenant: Tenant, now: float, ns: Namespace = ()) -> int:
        """Record that `tenant` holds every prefix of `key`, last used at `now`.

        Returns the length `tenant` already held before this insert (its expected cache hit).
        """
        _check_key(key)
        self._sizes.setdefault(tenant, 0)
        self._nodes.setdefault(tenant, 0)
        node = self._roots.get(ns)
        if node is None:
            node = self._roots[ns] = _Node(b"", None, {})
        pos, held = 0, -1
        while pos < len(key):
            child, n = _descend(node, key, pos)
            if child is None:
                held = pos if held < 0 else held
                self._add_leaf(node, key[pos:], tenant, now)
                break
            if n < len(child.edge):
                child = self._split(child, n)
            if held < 0 and tenant not in child.tenants:
                held = pos
            self._touch(child, tenant, now)
            pos, node = pos + n, child
        return (len(key) if held < 0 else held) // UNIT

    def evict_tenant_by_cost(self, max_cost: int) -> int:
        """Evict least recently used leaves of every tenant whose cost (key units plus
        node_units per node) is above `max_cost`; returns the key units evicted."""
        over = {t for t in self._sizes if self.cost(t) > max_cost}
        if not over:
            return 0
        heaps, held = self._leaf_heaps(over)
        evicted = sum(self._evict_tenant(t, heaps[t], held, max_cost) for t in over)
        self._drop_empty_roots()
        return evicted

    def evict_in_slices(self, max_cost: int, nodes_per_slice: int = 500) -> Iterator[int]:
        """One pass of evict_tenant_by_cost's eviction, as a generator that does at most about
        `nodes_per_slice` nodes of work between yields (it yields the units evicted so far), so
        that a caller can interleave it with inserts and matches instead of stalling them while
        it walks the whole tree. It drops only the leaves found by its walk: a leaf touched or
        grown since it was seen is skipped, and a node that becomes a leaf meanwhile (a parent
        of dropped leaves included) waits for the next pass, so a tenant far above `max_cost`
        may stay above it until then."""
        over = {t for t in self._sizes if self.cost(t) > max_cost}
        heaps: dict[Tenant, list[_HeapItem]] = {t: [] for t in over}
        done = 0
        for node in self._walk() if over else ():
            for tenant, (stamp, _) in node.tenants.items():
                if tenant in over and not self._holds_a_child(node, tenant):
                    heaps[tenant].append((stamp, next(self._seq), node))
            done += 1
            if done % nodes_per_slice == 0:
                yield 0
        evicted = 0
        for tenant, heap in heaps.items():
            heapq.heapify(heap)
            while heap and self.cost(tenant) > max_cost:
                stamp, _, node = heapq.heappop(heap)
                before, done = done, done + 1
                if self._still_a_leaf(node, tenant, stamp):
                    # Freeing a long edge costs like visiting many nodes: counted as such.
                    done += len(node.edge) // 1024
                    evicted += self._drop(node, tenant)
                if done // nodes_per_slice != before // nodes_per_slice:
                    yield evicted
        self._drop_empty_roots()
        yield evicted

    @staticmethod
    def _holds_a_child(node: _Node, tenant: Tenant) -> bool:
        return bool(node.children) and any(tenant in c.tenants for c in node.children.values())

    def _still_a_leaf(self, node: _Node, tenant: Tenant, stamp: float) -> bool:
        """Whether `node` is, as when it was seen, an untouched attached leaf of `tenant`."""
        use, parent = node.tenants.get(tenant), node.parent
        attached = parent is not None and (parent.children or {}).get(node.edge[:UNIT]) is node
        return (use is not None and use[0] == stamp and attached
                and not self._holds_a_child(node, tenant))  # fmt: skip

    def _drop(self, node: _Node, tenant: Tenant) -> int:
        del node.tenants[tenant]
        n = len(node.edge) // UNIT
        self._sizes[tenant] -= n
        self._nodes[tenant] -= 1
        if not node.tenants:
            self._detach(node)
        return n

    def remove_tenant(self, tenant: Tenant) -> None:
        """Forget everything `tenant` holds (a worker left)."""
        # Children before parents, so a node emptied here has no children left to orphan.
        for node in reversed(list(self._walk())):
            if node.tenants.pop(tenant, None) is not None and not node.tenants:
                self._detach(node)
        self._sizes.pop(tenant, None)
        self._nodes.pop(tenant, None)
        self._drop_empty_roots()

    def check_integrity(self) -> None:
        """Recount every per-tenant size and check the tree's structural invariants."""
        counts: dict[Tenant, int] = {}
        nodes: dict[Tenant, int] = {}
        for node in self._walk():
            self._check_node(node)
            for tenant in node.tenants:
                counts[tenant] = counts.get(tenant, 0) + len(node.edge) // UNIT
                nodes[tenant] = nodes.get(tenant, 0) + 1
        nonzero = {t: s for t, s in self._sizes.items() if s}
        _check(counts == nonzero, f"size counters {nonzero} != recount {counts}")
        nonzero = {t: n for t, n in self._nodes.items() if n}
        _check(nodes == nonzero, f"node counters {nonzero} != recount {nodes}")

    # ----- internals -----

    def _touch(self, node: _Node, tenant: Tenant, now: float) -> None:
        use = node.tenants.get(tenant)
        if use is None:
            self._sizes[tenant] += len(node.edge) // UNIT
            self._nodes[tenant] += 1
            node.tenants[tenant] = (now, 1)
        else:
            node.tenants[tenant] = (now, use[1] + 1)

    def _add_leaf(self, parent: _Node, edge: bytes, tenant: Tenant, now: float) -> None:
        if parent.children is None:
            parent.children = {}
        parent.children[edge[:UNIT]] = _Node(edge, parent, {tenant: (now, 1)})
        self._sizes[tenant] += len(edge) // UNIT
        self._nodes[tenant] += 1

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after `n` bytes; the new upper node inherits its tenants."""
        parent = child.parent
        assert parent is not None and parent.children is not None
        mid = _Node(child.edge[:n], parent, dict(child.tenants))
        for tenant in mid.tenants:
            self._nodes[tenant] += 1
        child.edge, child.parent = child.edge[n:], mid
        mid.children = {child.edge[:UNIT]: child}
        parent.children[mid.edge[:UNIT]] = mid
        return mid

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None and parent.children is not None
        del parent.children[node.edge[:UNIT]]
        if not parent.children:
            parent.children = None

    def _drop_empty_roots(self) -> None:
        # Namespaces churn (a cache salt per user), so empty subtrees must not linger.
        self._roots = {ns: root for ns, root in self._roots.items() if root.children}

    def _walk(self) -> Iterator[_Node]:
        """Every non-root node, parents before children."""
        stack = [c for root in self._roots.values() for c in (root.children or {}).values()]
        while stack:
            node = stack.pop()
            yield node
            if node.children:
                stack.extend(node.children.values())

    def _leaf_heaps(self, over: set[Tenant]) -> tuple[dict[Tenant, list[_HeapItem]], _Held]:
        """Per tenant in `over`, a heap of its leaves (nodes no child of which it holds), and
        how many children of each node it holds: counted once here, so that finding whether an
        evicted leaf's parent became a leaf does not rescan a parent of thousands of children."""
        nodes, held = list(self._walk()), {}
        for node in nodes:
            for tenant in node.tenants:
                if tenant in over:
                    held[node.parent, tenant] = held.get((node.parent, tenant), 0) + 1
        heaps: dict[Tenant, list[_HeapItem]] = {t: [] for t in over}
        for node in nodes:
            for tenant, (stamp, _) in node.tenants.items():
                if tenant in over and (node, tenant) not in held:
                    heaps[tenant].append((stamp, next(self._seq), node))
        for heap in heaps.values():
            heapq.heapify(heap)
        return heaps, held

    def _evict_tenant(
        self, tenant: Tenant, heap: list[_HeapItem], held: _Held, max_cost: int
    ) -> int:
        evicted = 0
        while heap and self.cost(tenant) > max_cost:
            _, _, node = heapq.heappop(heap)
            evicted += self._drop(node, tenant)
            parent = node.parent
            held[parent, tenant] -= 1
            if not held[parent, tenant] and tenant in parent.tenants:  # roots hold no tenant
                heapq.heappush(heap, (parent.tenants[tenant][0], next(self._seq), parent))
        return evicted

    def _check_node(self, node: _Node) -> None:
        parent = node.parent
        _check(parent is not None and bool(parent.children), "node without a parent link")
        assert parent is not None and parent.children is not None
        _check(len(node.edge) > 0 and len(node.edge) % UNIT == 0, "bad edge length")
        _check(parent.children.get(node.edge[:UNIT]) is node, "parent does not index node")
        _check(bool(node.tenants), "node held by no tenant")
        _check(node.children is None or bool(node.children), "empty children dict kept")
        if parent.parent is not None:
            _check(node.tenants.keys() <= parent.tenants.keys(), "holding is not prefix-closed")
