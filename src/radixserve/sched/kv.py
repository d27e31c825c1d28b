"""KVManager: the scheduler's KV memory, as the radix cache, the slot allocator and the slot table.

It owns every move of a slot between them (open, extend, cache, release), so that
free + evictable + protected + held == total holds after each one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from radixserve.cache.pool import RequestSlotTable, SlotAllocator
from radixserve.cache.radix import RadixCache, TreeNode, path_slots
from radixserve.cache.tiers import HostTier, PageCopy
from radixserve.config import CacheConfig
from radixserve.sched.request import Req


class KVManager:
    """Rule for callers: a running request's ``locked_node`` is locked exactly once by it (the
    scheduler locks the matched prefix at admission; ``cache_unfinished`` moves the lock)."""

    def __init__(self, config: CacheConfig, host_tokens: int = 0) -> None:
        self.config = config
        self.page = config.page_size
        self.enabled = not config.disable_radix_cache
        self.host = (
            HostTier(host_tokens, config.page_size, config.write_policy)
            if host_tokens and self.enabled
            else None
        )
        self.cache = RadixCache(config, self.host)
        self.allocator = SlotAllocator(config.max_total_tokens, config.page_size)
        self.table = RequestSlotTable(self.allocator)
        self.pins: dict[TreeNode, int] = {}  # nodes locked for a reader outside the scheduler

    @property
    def total(self) -> int:
        return self.allocator.total

    def room(self) -> int:
        """Slots a new allocation can get: free ones plus what eviction can free."""
        return self.allocator.available() + self.cache.evictable_size()

    def usage(self) -> float:
        """Share of the pool that cannot be had back: held by requests or locked in the tree."""
        return 1.0 - self.room() / self.total

    def _aligned(self, n: int) -> int:
        return n - n % self.page

    def ensure_free(self, n: int) -> bool:
        """Evict until ``n`` slots are free; False if even eviction cannot make them."""
        short = n - self.allocator.available()
        if short > 0 and self.enabled:
            self.allocator.free_runs(self.cache.evict_runs(short))
        return self.allocator.available() >= n

    def covers(self, num_decodes: int, extra: int = 0) -> bool:
        """The free slots hold a fresh page for each of ``num_decodes`` decodes plus ``extra``:
        then ``ensure_free`` of their exact need evicts nothing (the common case, checked in
        O(1) before the exact count)."""
        return self.allocator.available() >= num_decodes * self.page + extra

    # -- request lifecycle -------------------------------------------------------------------
    def lock(self, node: Any) -> None:
        if node is not None:
            self.cache.lock(node)

    def unlock(self, node: Any) -> None:
        if node is not None:
            self.cache.unlock(node)

    def pin(self, node: TreeNode) -> None:
        """Lock ``node`` (and its path) for a reader outside the scheduler (the storage tier's
        writer reading their device KV): not evicted, so their slots are not reused, until
        ``unpin``. Like a running request's prefix, a pinned path is not room for others."""
        self.cache.lock(node)
        self.pins[node] = self.pins.get(node, 0) + 1

    def unpin(self, node: TreeNode) -> None:
        count = self.pins[node]
        if count == 1:
            del self.pins[node]
        else:
            self.pins[node] = count - 1
        self.cache.unlock(node)

    def open(self, req: Req) -> None:
        """Give an admitted request its cached prefix (``req.match_node``, already locked)."""
        prefix = path_slots(req.match_node)[: req.prefix_len] if req.match_node else []
        self.table.open(req.rid, prefix)
        req.locked_node = req.match_node
        req.kv_len = req.prefix_len

    # -- the host tier -----------------------------------------------------------------------
    def load_host(self, req: Req, limit: int) -> int:
        """Bring up to ``limit`` tokens of ``req``'s prefix that continue its device match
        (``req.match_node``, locked) back from the host tier, when the device pool has room;
        the request's match and lock move down to the loaded nodes. Returns the tokens loaded
        (their copies wait in ``take_copies``)."""
        if self.host is None or limit < self.page or req.match_node is None:
            return 0
        end = req.prefix_len + limit
        chain = self.cache.match_host(req.fill_ids(), req.match_node, req.prefix_len, end)
        if not chain:
            return 0
        n = sum(len(node.key) for node in chain)
        self.cache.pin_host(chain, 1)
        if not self.ensure_free(n):
            self.cache.pin_host(chain, -1)
            return 0
        self.cache.load(chain, self.allocator.alloc(n))
        req.match_node = chain[-1]
        req.match_len += n
        req.prefix_len += n
        return n

    def take_copies(self) -> list[PageCopy]:
        """Page copies between the tiers, in order, to apply before the next forward."""
        return self.host.take_copies() if self.host is not None else []

    def extend(self, req: Req, n: int) -> list[int]:
        """Slots for ``n`` more positions of ``req``, evicting from the tree if needed."""
        if not self.ensure_free(self.table.extend_cost(req.rid, n)):
            raise RuntimeError(f"KV accounting error: no room for {n} slots of {req.rid!r}")
        return self.table.extend(req.rid, n)

    def extend_cost(self, req: Req, n: int) -> int:
        return self.table.extend_cost(req.rid, n)

    def held_by(self, req: Req) -> int:
        """Slots ``req`` owns (not the tree's), in whole pages."""
        own = len(self.table.slots(req.rid)) - self.table.owned_from(req.rid)
        return self.allocator.pages_for(own) * self.page

    def cache_unfinished(self, req: Req) -> None:
        """Put the computed part of a running request in the tree and lock it there, so the
        next chunk or the next request with the same prefix reuses it."""
        node = self._insert(req)
        if node is not None:
            self.cache.lock(node)
            self.unlock(req.locked_node)
            req.locked_node = node

    def release(self, req: Req, keep: bool = True) -> None:
        """Free a request's slots; with ``keep``, its computed tokens are cached first (a
        finished request: prompt + output but the last token, whose KV was never computed)."""
        if keep:
            self._insert(req)
        self.unlock(req.locked_node)
        req.locked_node = None
        self.table.close(req.rid)

    def _insert(self, req: Req) -> TreeNode | None:
        """Cache fill positions [0, kv_len) in whole pages; the request adopts the tree's
        slots (freeing its duplicates of what was cached already). Returns the end node."""
        n = self._aligned(req.kv_len)
        if not self.enabled or n <= self.table.owned_from(req.rid):
            return None
        tokens = self._keys(req.fill_slice(0, n))
        m = self.cache.insert_and_match(tokens, self.table.slots(req.rid), req.namespace,
                                        req.priority)  # fmt: skip
        assert m.length == n, f"inserted {n} tokens but matched {m.length}"
        self.table.adopt_prefix(req.rid, m.slots)
        return m.last_node

    def _keys(self, tokens: array) -> Sequence[int]:
        """``tokens`` as the tree's key array: as they are when of its type (the usual case:
        a request's ids are an array from the start), else converted once for the insert and
        the match that follows it (as a list if they do not fit: the tree then widens)."""
        code = self.cache.key_typecode
        if tokens.typecode == code:
            return tokens
        keys = array(code)
        try:
            keys.fromlist(tokens.tolist())
        except (OverflowError, TypeError):
            return tokens.tolist()
        return keys

    def flush(self) -> None:
        """Drop the whole tree (callers make sure nothing is locked or pinned)."""
        assert not self.pins, "flush with pinned nodes"
        self.allocator.free(self.cache.reset())

    # -- integrity ---------------------------------------------------------------------------
    def check(self, running: Iterable[Req], in_flight: bool) -> None:
        """Recount the pool, the tree and the locks the running requests hold."""
        running = list(running)
        a, c, t = self.allocator, self.cache, self.table
        parts = (a.available(), c.evictable_size(), c.protected_size(), t.held())
        assert sum(parts) == self.total, f"free+evictable+protected+held {parts} != {self.total}"
        c.check_integrity()  # both tiers: the host tier's slots too
        assert len(t) == len(running), f"{len(t)} slot-table entries, {len(running)} running"
        for req in running:
            assert req.rid in t, f"{req.rid} runs without slots"
            if not in_flight:
                assert len(t.slots(req.rid)) == req.kv_len, f"{req.rid}: slots != kv_len"
        self._check_locks(running)

    def _check_locks(self, running: list[Req]) -> None:
        want: dict[TreeNode, int] = {}
        held = [(req.locked_node, 1) for req in running]
        for node, count in [*held, *self.pins.items()]:
            while node is not None and not node.is_root:
                want[node] = want.get(node, 0) + count
                node = node.parent
        stack = [self.cache.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.is_root:
                got = node.lock_ref
                assert got == want.get(node, 0), f"{node!r}: lock_ref {got} != {want.get(node)}"
