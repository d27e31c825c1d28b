"""BlockTracker: the radix cache's changes as KV-cache block events (BlockStored, BlockRemoved,
AllBlocksCleared), in fixed blocks of ``block_size`` tokens with chained hashes.

Pure Python, no I/O: a tree listener that turns inserts and evictions into event objects; the
engine's publisher (engine/kv_events.py) sends them, and the simulator may read them in process.

Rules it keeps (what a subscriber may rely on):
- only full blocks are announced, once each, when their last token enters the tree; a node split
  changes nothing; a block is removed when the leaf holding its last token is evicted, and
  ``clear()`` (after the cache was reset) announces AllBlocksCleared;
- block ``i`` of a namespace's path has the chained hash of ``cache/hashing.py`` over tokens
  ``[0, (i + 1) * block_size)``, the namespace string as the hash's namespace; events carry it
  as a 64-bit unsigned int (xxhash64: the hash itself; sha256 family: the digest's last 8 bytes,
  big-endian, as vLLM turns its digests into ints);
- a request's namespace (the engine's ``"salt:<cache_salt>"``) travels in ``extra_keys``: the
  first block of the namespace (no parent) carries ``[cache_salt]``, later blocks ``None`` (their
  parent link carries it), as vLLM does with its cache salt; ``lora_name`` names a LoRA
  namespace (``"lora:<name>"``), None otherwise.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

from radixserve.cache.hashing import ALGORITHMS
from radixserve.cache.kv_event_types import (  # noqa: F401  (KVEvent: re-exported)
    MEDIUM,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    engine_namespace,
    wire_namespace,
)
from radixserve.cache.radix import RadixCache, TreeNode


def namespace_fields(namespace: Hashable | None) -> tuple[str | None, Any]:
    """(lora_name, the first block's extra_keys entry) of an engine namespace."""
    return wire_namespace(engine_namespace(namespace))


class BlockTracker:
    """Tree listener: which full blocks each node holds (those whose last token lies in it).

    Per node it keeps the chained hash states of those blocks and the node's end depth, so an
    insert hashes only the new blocks and an eviction knows what it removes without hashing.
    """

    def __init__(
        self, cache: RadixCache, block_size: int = 16, hash_algo: str = "xxhash64",
        hash_seed: int = 0,
    ) -> None:  # fmt: skip
        if block_size < 1 or block_size % cache.page_size:
            raise ValueError(f"block_size {block_size} must be a positive multiple of the page "
                             f"size {cache.page_size}")  # fmt: skip
        if hash_algo not in ALGORITHMS:
            raise ValueError(f"unknown hash algorithm {hash_algo!r}; choose from "
                             f"{sorted(ALGORITHMS)}")  # fmt: skip
        self.cache, self.block_size = cache, block_size
        self.hash_algo, self.hash_seed = hash_algo, hash_seed
        self._algo = ALGORITHMS[hash_algo]
        self._blocks: dict[TreeNode, list[Any]] = {}  # node -> hash states of the blocks it ends
        self._depth: dict[TreeNode, int] = {}  # node -> tokens from its namespace root to its end
        self.pending: list[KVEvent] = []
        self.num_blocks = 0
        cache.listeners.append(self)
        cache.host_listeners.append(self)

    # -- hashes ------------------------------------------------------------------------------
    def external(self, state: Any) -> int:
        """The 64-bit int an event carries for a chain state."""
        return state if isinstance(state, int) else int.from_bytes(state[-8:], "big")

    def _root_state(self, namespace: Hashable | None) -> Any:
        return self._algo.root("" if namespace is None else str(namespace), self.hash_seed)

    # -- listener ------------------------------------------------------------------------------
    def on_insert(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        start = self._depth.get(parent, 0)  # namespace roots are at depth 0
        end = self._depth[node] = start + len(node.key)
        first, last = start // self.block_size, end // self.block_size
        if first == last:
            return
        carry = self._tail(parent, start % self.block_size)
        tokens = carry + node.key[: last * self.block_size - start].tolist()
        prev, namespace = self._parent_state(parent)
        states = self._algo.chain(prev, tokens, self.block_size, self.hash_seed)
        self._blocks[node] = states
        self.num_blocks += len(states)
        self.pending.append(self._stored(states, prev, tokens, namespace, first == 0))

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        end = self._depth[lower]
        start = end - len(upper.key) - len(lower.key)
        mid = self._depth[upper] = start + len(upper.key)
        cut = mid // self.block_size - start // self.block_size
        states = self._blocks.pop(lower, None)
        if states:
            if cut:
                self._blocks[upper] = states[:cut]
            if states[cut:]:
                self._blocks[lower] = states[cut:]

    def on_evict(self, node: TreeNode) -> None:
        self._depth.pop(node, None)
        states = self._blocks.pop(node, None)
        if not states:
            return
        self.num_blocks -= len(states)
        hashes = [self.external(s) for s in states]
        if self.pending and isinstance(self.pending[-1], BlockRemoved):
            self.pending[-1].block_hashes.extend(hashes)
        else:
            self.pending.append(BlockRemoved(hashes, MEDIUM))

    # -- the host tier (medium "CPU", as vLLM's CPU offloading announces its blocks) ----------
    def on_host_store(self, node: TreeNode) -> None:
        """``node``'s KV got a host copy: its full blocks are stored in the host medium too."""
        got = self._path_blocks(node)
        if got is not None:
            states, parent, tokens, namespace = got
            hashes = [self.external(s) for s in states]
            ns = engine_namespace(namespace)
            self.pending.append(BlockStored(hashes, parent, tokens, self.block_size, ns,
                                            MEDIUM_HOST))  # fmt: skip

    def on_host_remove(self, node: TreeNode) -> None:
        """``node``'s host copy is gone: its full blocks left the host medium."""
        got = self._path_blocks(node)
        if got is not None:
            self.pending.append(BlockRemoved([self.external(s) for s in got[0]], MEDIUM_HOST))

    def _path_blocks(self, node: TreeNode) -> tuple[list[Any], Any, list[int], Any] | None:
        """The chain states of the full blocks whose last token lies in ``node``, their parent
        hash (None at a chain's root), their tokens and the namespace; hashed from the path
        (host-only nodes keep no states here)."""
        parts: list[list[int]] = []
        top = node
        while top.key:
            parts.append(top.key.tolist())
            top = top.parent  # type: ignore[assignment]
        path = [t for part in reversed(parts) for t in part]
        bs = self.block_size
        end, start = len(path), len(path) - len(node.key)
        first, last = start // bs, end // bs
        if first == last:
            return None
        namespace = self._namespace_of(top)
        root = self._root_state(namespace)
        states = self._algo.chain(root, path[: last * bs], bs, self.hash_seed)
        parent = None if first == 0 else self.external(states[first - 1])
        return states[first:], parent, path[first * bs : last * bs], namespace

    def clear(self) -> None:
        """The cache was reset: forget every block and announce AllBlocksCleared."""
        self._blocks.clear()
        self._depth.clear()
        self.num_blocks = 0
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        out, self.pending = self.pending, []
        return out

    # -- helpers -------------------------------------------------------------------------------
    def _tail(self, node: TreeNode, n: int) -> list[int]:
        """The last ``n`` tokens of the path that ends at ``node``."""
        parts: list[list[int]] = []
        while n > 0 and node.key:
            take = min(n, len(node.key))
            parts.append(node.key[len(node.key) - take :].tolist())
            n -= take
            node = node.parent  # type: ignore[assignment]
        return [t for part in reversed(parts) for t in part]

    def _parent_state(self, node: TreeNode) -> tuple[Any, Hashable | None]:
        """The chain state of the last full block at or above ``node`` (the namespace root's
        state if none), and the namespace."""
        state = None
        while node.key:
            if state is None and node in self._blocks:
                state = self._blocks[node][-1]
            node = node.parent  # type: ignore[assignment]
        namespace = self._namespace_of(node)
        return (self._root_state(namespace) if state is None else state), namespace

    def _namespace_of(self, ns_root: TreeNode) -> Hashable | None:
        for ns, root in self.cache.root.children.items():
            if root is ns_root:
                return ns
        raise AssertionError("a node outside every namespace")

    def _stored(
        self, states: list[Any], prev: Any, tokens: list[int], namespace: Hashable | None,
        at_root: bool,
    ) -> BlockStored:  # fmt: skip
        parent = None if at_root else self.external(prev)
        hashes = [self.external(s) for s in states]
        ns = engine_namespace(namespace)
        return BlockStored(hashes, parent, tokens, self.block_size, ns, MEDIUM)

    # -- snapshot and integrity ------------------------------------------------------------------
    def blocks(self) -> Iterator[dict[str, Any]]:
        """Every block the tree holds now, parents before children, recomputed from the tree
        (the snapshot of what the event stream has announced so far)."""
        for ns, root in list(self.cache.root.children.items()):
            lora, first_keys = namespace_fields(ns)
            stack: list[tuple[TreeNode, list[int], int | None]] = [
                (child, [], None) for child in root.children.values()
            ]
            while stack:
                node, carry, parent = stack.pop()
                tokens = carry + node.key.tolist()
                full = len(tokens) - len(tokens) % self.block_size
                for i, state in enumerate(self._blocks.get(node, ())):
                    h = self.external(state)
                    toks = tokens[i * self.block_size : (i + 1) * self.block_size]
                    yield {"block_hash": h, "parent_block_hash": parent, "token_ids": toks,
                           "lora_name": lora, "extra_keys": first_keys if parent is None
                           else None}  # fmt: skip
                    parent = h
                stack.extend((c, tokens[full:], parent) for c in node.children.values())

    def check(self) -> None:
        """Recount: every device node's blocks are exactly the full blocks ending in it, with
        the hashes ``cache/hashing.py`` gives its path, and ``num_blocks`` is their number.
        Host-only nodes (and their subtrees, host-only too) announce nothing: skipped."""
        from radixserve.cache.hashing import block_hashes

        count = 0
        for ns, root in self.cache.root.children.items():
            stack = [(c, []) for c in root.children.values() if c.value is not None]
            while stack:
                node, path = stack.pop()
                path = path + node.key.tolist()
                want = block_hashes(path, self.block_size, self.hash_algo, self.hash_seed,
                                    None if ns is None else str(ns))  # fmt: skip
                start = (len(path) - len(node.key)) // self.block_size
                got = self._blocks.get(node, [])
                assert self._depth.get(node) == len(path), f"{node!r}: depth"
                assert [self._out(s) for s in got] == want[start:], f"{node!r}: blocks"
                count += len(got)
                stack.extend((c, path) for c in node.children.values() if c.value is not None)
        assert count == self.num_blocks, f"num_blocks {self.num_blocks} != {count}"
        assert set(self._blocks) <= set(self._depth), "blocks of a node without a depth"

    def _out(self, state: Any) -> Any:
        return self._algo.out(state)
