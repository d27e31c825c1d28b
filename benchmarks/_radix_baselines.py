"""The radix trees radix_bench.py measures ours against: SGLang 0.5.23's production
``UnifiedRadixCache`` on its Rust tree core (when the ``sglang`` package imports), and a plain
pure-Python radix tree (the fallback, and a floor). Each exposes the calls the benchmark makes:
``key`` and ``values`` (its natural key and value types, made outside the timing),
``match_prefix``, ``insert``, ``evict`` (which gives the freed KV slots back to its own
allocator; None where a tree has no eviction)."""

from __future__ import annotations

from array import array
from typing import Any

from radixserve.cache.pool import SlotAllocator
from radixserve.cache.radix import RadixCache, token_array


class Ours:
    """radixserve's RadixCache and SlotAllocator, fed what the scheduler feeds them: token ids
    as the array a ``Req`` holds (``token_array``), slots as ``array('q')``."""

    name = "radixserve"

    def __init__(self, capacity: int) -> None:
        self.cache = RadixCache()
        self.alloc = SlotAllocator(capacity)

    @staticmethod
    def key(tokens: list[int]) -> Any:
        return token_array(tokens)

    def values(self, length: int) -> Any:
        return self.alloc.alloc(length)

    def match_prefix(self, key: Any) -> int:
        return self.cache.match_prefix(key).length

    def insert(self, key: Any, value: Any) -> int:
        n = self.cache.insert(key, value)
        if n:  # the slots of what was cached already go back, as SGLang's insert does
            self.alloc.free(value[:n])
        return n

    def evict(self, num_tokens: int) -> int:
        runs = self.cache.evict_runs(num_tokens)
        self.alloc.free_runs(runs)
        return sum(map(len, runs))


class SGLangUnified:
    """SGLang's UnifiedRadixCache (page size 1, full attention only) with its default tree
    core, the Rust one, on a CPU token allocator: what its scheduler calls, with the
    ``RadixKey(array('q'))`` its requests hold and values from its own allocator.

    Its allocator's ``free`` appends to the free list with ``torch.cat``, a copy of the whole
    list per call: a device memcpy on a GPU, but megabytes of CPU copying per call here, which
    would swamp its tree. So the frees its insert and evict make are queued (a list append)
    instead: SGLang's rows time its tree and eviction walk, not that copy, while ours also pay
    for giving the slots back to our allocator (a conservative comparison for us)."""

    name = "SGLang"
    core = "rust"  # its tree core (SGLang's default; CacheInitParams.tree_core_backend)

    def __init__(self, capacity: int) -> None:
        import torch
        from sglang.srt.mem_cache import base_prefix_cache as bpc
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        torch.set_num_threads(1)  # as ours: one thread (an idle pool spins on a shared machine)
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1))
        kv = MHATokenToKVPool(size=capacity, page_size=1, dtype=torch.bfloat16, head_num=1,
                              head_dim=1, layer_num=1, device="cpu", enable_memory_saver=False)  # fmt: skip
        self.alloc = TokenToKVPoolAllocator(
            size=capacity, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
        )
        reqs = ReqToTokenPool(size=4, max_context_len=16, device="cpu", enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=reqs,
                                 token_to_kv_pool_allocator=self.alloc, page_size=1,
                                 tree_components=(ComponentType.FULL,), eviction_policy="lru",
                                 tree_core_backend=self.core)  # fmt: skip
        self.cache = UnifiedRadixCache(params=params)
        self.freed: list[Any] = []
        self.alloc.free = self.freed.append  # type: ignore[method-assign]
        self.backend = self.cache._tree_core_backend
        self._key, self._bpc = RadixKey, bpc

    def key(self, tokens: list[int]) -> Any:
        return self._key(array("q", tokens))

    def values(self, length: int) -> Any:
        return self.alloc.alloc(length)

    def match_prefix(self, key: Any) -> int:
        return self.cache.match_prefix(self._bpc.MatchPrefixParams(key=key)).device_prefix_len

    def insert(self, key: Any, value: Any) -> int:
        return self.cache.insert(self._bpc.InsertParams(key=key, value=value)).prefix_len

    def evict(self, num_tokens: int) -> int:
        got = self.cache.evict(self._bpc.EvictParams(num_tokens=num_tokens))
        return got.num_tokens_evicted


class SGLangPython(SGLangUnified):
    """The same UnifiedRadixCache on SGLang's pure-Python tree core."""

    core = "python"


def sglang_status() -> str | None:
    """None when SGLang's UnifiedRadixCache runs here on its Rust core, else why not."""
    try:
        backend = SGLangUnified(16).backend
    except Exception as e:  # not installed, or its import chain fails here
        return f"sglang does not import ({type(e).__name__}: {str(e)[:80]})"
    return None if backend == "rust" else f"SGLang picked its {backend!r} tree core"


# -- the baseline: a plain radix tree, keys compared token by token -----------------------------
class _LoopNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "hits")

    def __init__(self, key: list[int], value: list[int], parent: _LoopNode | None) -> None:
        self.children: dict[int, _LoopNode] = {}
        self.parent, self.key, self.value = parent, key, value
        self.lock_ref, self.last_access, self.hits = 0, 0, 0


class _LoopMatch:
    __slots__ = ("last_node", "length")

    def __init__(self, last_node: _LoopNode, length: int) -> None:
        self.last_node, self.length = last_node, length


def _loop_match(key: list[int], tokens: list[int]) -> int:
    i = 0
    for a, b in zip(key, tokens):
        if a != b:
            break
        i += 1
    return i


class LoopRadix:
    """SGLang's RadixCache algorithm (page size 1) with Python lists for keys and values."""

    def __init__(self) -> None:
        self.root = _LoopNode([], [], None)
        self.tick = 0

    def match_prefix(self, key: list[int]) -> _LoopMatch:
        self.tick += 1
        node, length = self.root, 0
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access, child.hits = self.tick, child.hits + 1
            n = _loop_match(child.key, key)
            length += n
            if n < len(child.key):
                node = self._split(child, n)
                break
            node, key = child, key[n:]
        return _LoopMatch(node, length)

    def insert(self, key: list[int], value: list[int]) -> int:
        self.tick += 1
        node, total = self.root, 0
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access = self.tick
            n = _loop_match(child.key, key)
            total += n
            key, value = key[n:], value[n:]
            if n < len(child.key):
                child = self._split(child, n)
            node = child
        if key:
            leaf = _LoopNode(key, value, node)
            node.children[key[0]] = leaf
        return total

    def _split(self, child: _LoopNode, n: int) -> _LoopNode:
        parent = child.parent
        assert parent is not None
        upper = _LoopNode(child.key[:n], child.value[:n], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.hits = child.hits
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper


class Loop:
    """LoopRadix behind the benchmark's calls: lists for keys and values, no allocator."""

    name = "loop"

    def __init__(self, capacity: int) -> None:
        self.cache = LoopRadix()
        self._next = 0

    @staticmethod
    def key(tokens: list[int]) -> Any:
        return list(tokens)

    def values(self, length: int) -> Any:
        self._next += length
        return list(range(self._next - length, self._next))

    def match_prefix(self, key: Any) -> int:
        return self.cache.match_prefix(key).length

    def insert(self, key: Any, value: Any) -> int:
        return self.cache.insert(key, value)

    evict = None  # it has no eviction: those rows show "-"
