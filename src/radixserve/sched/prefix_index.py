"""PrefixIndex: every waiting request's longest cached prefix, kept current as the tree changes.

A request is matched once when it starts waiting; after that only tree changes that can touch it
make it re-match, so a scheduling pass never costs queue length x prompt length.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from radixserve.cache.radix import RadixCache, TreeNode
from radixserve.sched.request import Req

# Why a request can only change when these happen (matches always end on node boundaries,
# because match_prefix splits the node a match ends in):
#   insert  a new leaf under node N extends exactly the requests that wait at N and whose next
#           page is the leaf's first page; they are marked dirty and re-matched at refresh().
#   evict   removes a leaf L (never an inner node), so the requests at L now end at L.parent,
#           len(L.key) tokens shorter; they are moved at once, no matching needed.
#   split   cuts a node in two; a request at the cut node keeps the same (lower) node object
#           and depth, and no request can end inside a node, so nothing moves.
# Re-matching is deferred to refresh() because a listener runs inside the cache's own insert
# and evict loops, where a match (which may split) must not run.

MoveHook = Callable[[Req, Any], None]  # (request, the node it was at before)
SplitHook = Callable[[TreeNode, TreeNode], None]


class PrefixIndex:
    """Tree listener that maps (node, next page) -> the waiting requests whose match ends there.

    ``on_move(req, old_node)`` is called whenever a tracked request's match changes after it
    was tracked (for policies that order by it); ``on_split`` forwards the tree's splits.
    """

    def __init__(
        self,
        cache: RadixCache,
        enabled: bool = True,
        on_move: MoveHook | None = None,
        on_split: SplitHook | None = None,
    ) -> None:
        self.cache = cache
        self.page = cache.page_size
        self.enabled = enabled
        self.on_move: MoveHook = on_move or (lambda req, old: None)
        self.split_hook: SplitHook = on_split or (lambda upper, lower: None)
        self._at: dict[TreeNode, dict[Hashable, dict[Req, None]]] = {}
        self._key_of: dict[Req, Hashable] = {}
        self._dirty: dict[Req, None] = {}  # ordered, so re-matching order is deterministic
        self.refreshed = 0  # re-matches a tree change caused: the incremental index's work
        if enabled:
            cache.listeners.append(self)

    def __len__(self) -> int:
        return len(self._key_of)

    # -- tracking ----------------------------------------------------------------------------
    def track(self, req: Req) -> None:
        """Match ``req`` now and follow the tree from here on."""
        if not self.enabled:
            req.match_node, req.match_len, req.prefix_len, req.host_len = None, 0, 0, 0
            return
        self._match(req)

    def untrack(self, req: Req) -> None:
        if req in self._key_of:
            self._unplace(req)
        self._dirty.pop(req, None)

    def refresh(self) -> int:
        """Re-match the requests a tree change may have extended; returns how many."""
        dirty, self._dirty = self._dirty, {}
        self.refreshed += len(dirty)
        for req in dirty:
            old, old_host = req.match_node, req.host_len
            self._unplace(req)
            self._match(req)
            if req.match_node is not old or req.host_len != old_host:
                self.on_move(req, old)
        return len(dirty)

    # -- placement ---------------------------------------------------------------------------
    def _match(self, req: Req) -> None:
        m = self.cache.match_prefix(req.fill_ids(), req.namespace)
        self._place(req, m.last_node, m.length)

    def _cap(self, req: Req) -> int:
        # at least the last token must be computed, or there would be no logits to sample from
        n = req.fill_len - 1
        return n - n % self.page

    def _next_key(self, req: Req, length: int) -> Hashable:
        """The child key under which a longer match would continue (None: it cannot help)."""
        if length >= self._cap(req):
            return None
        if self.page == 1:
            return req.fill_slice(length, length + 1)[0]
        return tuple(req.fill_slice(length, length + self.page))

    def _place(self, req: Req, node: TreeNode, length: int) -> None:
        req.match_node, req.match_len = node, length
        req.prefix_len = min(length, self._cap(req))
        req.host_len = self._host_len(req)
        key = self._next_key(req, length)
        self._at.setdefault(node, {}).setdefault(key, {})[req] = None
        self._key_of[req] = key

    def _host_len(self, req: Req) -> int:
        """Usable tokens past ``req``'s device match that the host tier holds (read only: host
        nodes lie below device ones, so both tiers' leading run minus the device match). An
        ordering hint for LPM, refreshed whenever the device match moves."""
        if getattr(self.cache, "host", None) is None:
            return 0
        # from the device match: the walk down to it was just made
        held = self.cache.cached_len(req.fill_ids(), req.namespace, (req.match_node, req.match_len))
        return max(0, min(held, self._cap(req)) - req.prefix_len)

    def _unplace(self, req: Req) -> None:
        key = self._key_of.pop(req)
        by_key = self._at[req.match_node]
        bucket = by_key[key]
        del bucket[req]
        if not bucket:
            del by_key[key]
            if not by_key:
                del self._at[req.match_node]

    # -- tree listener -----------------------------------------------------------------------
    def _child_key(self, tokens: list[int]) -> Hashable:
        # mirrors RadixCache's child keys: the first token, or the first page as a tuple
        return tokens[0] if self.page == 1 else tuple(tokens[: self.page])

    def on_insert(self, node: TreeNode) -> None:
        bucket = self._at.get(node.parent, {}).get(self._child_key(node.key))  # type: ignore[arg-type]
        if bucket:
            self._dirty.update(bucket)

    def on_evict(self, node: TreeNode) -> None:
        by_key = self._at.pop(node, None)
        if not by_key:
            return
        parent = node.parent
        assert parent is not None
        for bucket in by_key.values():
            for req in bucket:
                del self._key_of[req]
                self._place(req, parent, req.match_len - len(node.key))
                self.on_move(req, node)

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        self.split_hook(upper, lower)

    # -- integrity ---------------------------------------------------------------------------
    def check(self, waiting: Iterable[Req]) -> None:
        """Every waiting request is tracked at a live node of the right depth, and is dirty
        whenever the tree could extend its match."""
        waiting = list(waiting)
        if not self.enabled:
            assert all(r.prefix_len == 0 for r in waiting)
            return
        assert len(waiting) == len(self._key_of), "index and waiting queue disagree"
        for req in waiting:
            node, depth = req.match_node, 0
            assert self._key_of[req] == self._next_key(req, req.match_len)
            while node.parent is not None:
                key = self._child_key(node.key) if node.key else req.namespace
                assert node.parent.children.get(key) is node, f"{req.rid}: detached match node"
                depth += len(node.key)
                node = node.parent
            assert depth == req.match_len, f"{req.rid}: depth {depth} != {req.match_len}"
            key = self._key_of[req]
            child = req.match_node.children.get(key) if key is not None else None
            if child is not None and child.value is not None:  # (not a host-only node)
                assert req in self._dirty, f"{req.rid}: extendable match not marked dirty"
