"""The simulated fleet-wide KV store (``radixserve sim --kv-store-gb``): whole blocks of KV,
each known by the tokens of its prefix, least recently used evicted first, bounded.

It behaves as a map from chained block keys (a block's key fixes every token before it) with a
per-block LRU, where a write or a hit touches a chain's blocks last to first. It is kept as a
trie of token spans instead, which answers the same questions without a key or an LRU entry
per block: a chain's first block is always touched after its later ones, so every block is more
recently used than the blocks below it, the store holds a prefix-closed set of chains, and the
least recently used block is always the last block of a leaf. So:

- a span (a trie node) holds whole blocks all last touched by the same write, whose stamps
  (the global touch order) count down along the span: the span keeps its last block's, and
  block ``i`` of ``m`` has ``stamp + m - 1 - i``;
- a write walks its chain once, splitting a span where the chain leaves it or ends inside it,
  and restamps the path;
- eviction pops leaves by their last block's stamp and cuts each in one slice (no other
  block's stamp falls among a span's), so ``n`` evicted blocks cost a few slices, not ``n``
  pops.

Tokens are compared as C arrays (one compare a span); a span's children are found by the bytes
of their first block, so no block gets a key, a hash or an object of its own.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from heapq import heappop, heappush

from radixserve.cache.tokens import common_len, token_array


class _Span:
    """Whole blocks of one chain in the trie, all last touched by the same write."""

    __slots__ = ("tokens", "parent", "children", "stamp")

    def __init__(self, tokens: array, parent: _Span | None, stamp: int) -> None:
        self.tokens = tokens
        self.parent = parent  # None: the root
        self.children: dict[bytes, _Span] = {}  # by their first block (``_block_key``)
        self.stamp = stamp  # its last block's place in the touch order


class SimStore:
    """Whole blocks of KV under their prefixes, least recently used evicted first."""

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block = block_tokens
        self.capacity = capacity_tokens // block_tokens  # in blocks
        self._root = _Span(array("I"), None, 0)
        self._blocks = 0  # held
        self._clock = 0  # stamps handed out
        self._leaf_at: dict[int, _Span] = {}  # every leaf, by its last block's stamp
        self._stamps: list[int] = []  # a heap of those stamps (and of some gone: skipped)
        self.written = self.evicted = self.read = 0  # blocks, ever

    def __len__(self) -> int:
        return self._blocks

    def leading(self, tokens: Sequence[int]) -> int:
        """How many of the whole blocks of ``tokens``, from the first, the store holds."""
        b, node, pos = self.block, self._root, 0
        end = len(tokens) - len(tokens) % b
        while pos < end:
            child = node.children.get(_block_key(tokens[pos : pos + b]))
            if child is None:
                break
            n = self._common(child.tokens, tokens, pos, end)
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return pos // b

    def read_blocks(self, tokens: Sequence[int], blocks: int) -> None:
        """A get of the first ``blocks`` blocks of ``tokens`` (held when it started): those
        still held become the most recently used (one evicted meanwhile was read before it
        went)."""
        self.read += blocks
        tokens = token_array(tokens)[: blocks * self.block]
        held = self.leading(tokens)
        if held:
            self.write(tokens[: held * self.block])  # adds nothing: only touches

    def write(self, tokens: Sequence[int]) -> None:
        """Put the whole blocks of ``tokens`` (those already held are only touched), then
        evict to capacity."""
        tokens = token_array(tokens)
        b = self.block
        n = len(tokens) // b
        if not n:
            return
        base, self._clock = self._clock, self._clock + n
        added = self._walk(tokens, n * b, base + n)
        self._blocks += added
        self.written += added
        if self._blocks > self.capacity:
            self._evict(self._blocks - self.capacity)

    def _walk(self, tokens: array, end: int, top: int) -> int:
        """Put ``tokens[:end]`` on a path of spans, each stamped as ``top`` minus the blocks
        down to its end (the chain's first block gets ``top - 1``); returns blocks added."""
        b, node, pos, leaf_at = self.block, self._root, 0, self._leaf_at
        while pos < end:
            key = _block_key(tokens[pos : pos + b])
            child = node.children.get(key)
            if child is None:  # the rest is new: one leaf, the chain's oldest blocks
                leaf = node.children[key] = _Span(tokens[pos:end], node, top - end // b)
                self._add_leaf(leaf)
                return (end - pos) // b
            n = self._common(child.tokens, tokens, pos, end)
            if n < len(child.tokens):
                child = self._split(node, child, key, n)
            elif not child.children:
                del leaf_at[child.stamp]  # restamped below (and maybe no leaf after)
            pos += n
            child.stamp = top - pos // b
            node = child
        if not node.children:  # the chain ends at a leaf
            self._add_leaf(node)
        return 0

    def _common(self, span: array, tokens: Sequence[int], pos: int, end: int) -> int:
        """Whole blocks (in tokens) that ``span`` and ``tokens[pos:end]`` share from the start
        (tokens given as a list are converted only as far as they are compared)."""
        n = min(len(span), end - pos)
        part = tokens[pos : pos + n]
        if type(part) is not array:
            part = token_array(part)
        if (span if n == len(span) else span[:n]) != part:
            n = common_len(span, part, 0, n)
        return n - n % self.block

    def _split(self, parent: _Span, child: _Span, key: bytes, n: int) -> _Span:
        """Cut ``child`` after its first ``n`` tokens: a new span above it takes them (and the
        stamp of its last block); ``child`` keeps the rest and its last block (a leaf stays
        one, at the same stamp)."""
        m = len(child.tokens) // self.block
        upper = _Span(child.tokens[:n], parent, child.stamp + m - n // self.block)
        child.tokens = child.tokens[n:]
        child.parent = upper
        upper.children[_block_key(child.tokens[: self.block])] = child
        parent.children[key] = upper
        return upper

    def _add_leaf(self, leaf: _Span) -> None:
        leaf_at, stamps = self._leaf_at, self._stamps
        leaf_at[leaf.stamp] = leaf
        if len(stamps) > 2 * len(leaf_at) + 64:  # mostly stamps gone: keep the live ones
            stamps[:] = sorted(leaf_at)  # sorted is a heap
        else:
            heappush(stamps, leaf.stamp)

    def _evict(self, over: int) -> None:
        """Drop the ``over`` least recently used blocks, a leaf's tail at a time: the oldest
        leaf's blocks are older than any other block (its stamps run unbroken), so it loses
        as many as are still to go, in one cut."""
        b, stamps, leaf_at = self.block, self._stamps, self._leaf_at
        self._blocks -= over
        self.evicted += over
        while over > 0:
            leaf = leaf_at.pop(heappop(stamps), None)
            if leaf is None:  # that stamp's block was touched since, or is no leaf's last
                continue
            m = len(leaf.tokens) // b
            if over < m:
                del leaf.tokens[(m - over) * b :]
                leaf.stamp += over
                self._add_leaf(leaf)
                return
            over -= m
            parent = leaf.parent
            assert parent is not None
            del parent.children[_block_key(leaf.tokens[:b])]
            if not parent.children and parent is not self._root:
                self._add_leaf(parent)

    def check(self) -> None:
        """Recount: the blocks held, within capacity, every block written and not evicted; a
        span's blocks older than its parent's; the leaves, each under its stamp."""
        b, blocks, leaves, stack = self.block, 0, {}, [self._root]
        while stack:
            node = stack.pop()
            blocks += len(node.tokens) // b
            assert len(node.tokens) % b == 0, "a span of part of a block"
            for key, child in node.children.items():
                assert child.parent is node, "a span under the wrong parent"
                assert key == _block_key(child.tokens[:b]), "a span under the wrong key"
                first = child.stamp + len(child.tokens) // b - 1
                assert node is self._root or first < node.stamp, "a block newer than its parent"
                stack.append(child)
            if not node.children and node is not self._root:
                leaves[node.stamp] = node
        assert leaves == self._leaf_at, "the leaves by stamp drifted"
        assert set(leaves) <= set(self._stamps), "a leaf's stamp left the heap"
        assert blocks == self._blocks <= self.capacity, f"store holds {blocks} blocks"
        assert self.written - self.evicted == blocks, "store block count drifted"


def _block_key(block: Sequence[int]) -> bytes:
    """A block's tokens as a dict key: their bytes as 32-bit ids (hashed in C, no int object
    per token); ids past 32 bits as 64-bit ones (no 32-bit key is as long)."""
    if type(block) is array and block.typecode == "I":
        return block.tobytes()
    try:
        return array("I", block).tobytes()
    except OverflowError:
        return array("Q", block).tobytes()
