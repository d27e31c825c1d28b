"""Precise prefix index: which KV blocks each worker really holds, built from its KV events.
Owns the BlockIndex interface (what kv_aware reads and event subscribers write), the router's
block keys, and InMemoryIndex. Pure: no I/O, no clock, no threads."""

# Keys. A block's key is the router's OWN chained hash (cache/hashing.py, xxhash64, seed 0)
# recomputed from the event's token ids and its parent's key, never the engine's hash: so
# engines whose hash the router cannot reproduce (vLLM's, SGLang's, or ours with another
# algorithm or seed) are indexed as well as any, and a request's keys are simply
# block_keys(prompt ids, block size, namespace). Per worker, a map engine hash -> router key
# resolves BlockRemoved and finds a child's parent. The namespace (LoRA adapter, cache salt)
# seeds the root of every chain, so blocks of different namespaces never share a key.
#
# Block size. Learned per worker from its events (len(token_ids) / len(block_hashes)); the
# caller asks for keys at each size it is told (prefix_tokens's keys_for), so one fleet may mix
# block sizes. A worker that changes block size is reset: its old keys mean nothing at the new.
#
# Bounds. The index holds exactly the blocks an engine announced and has not removed, so its
# memory is bounded by what the engines hold. A BlockStored whose parent the index does not
# know (announced before the router subscribed, or lost) cannot be keyed and is counted as an
# orphan: those blocks cannot be part of a contiguous prefix anyway.
#
# Matching. prefix_tokens gives each worker's longest CONTIGUOUS run of held keys from the
# first block: a block held without its parent (vLLM can evict a parent first) is no hit,
# because the engine would have to recompute the parent and everything after it.

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from radixserve.cache.hashing import ALGORITHMS, block_hashes
from radixserve.router.kvindex.event_format import (
    DEVICE_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
)

WorkerId = Hashable
BlockKey = int
KEY_ALGORITHM = "xxhash64"
KEY_SEED = 0
_ALGO = ALGORITHMS[KEY_ALGORITHM]


def block_keys(token_ids: Sequence[int], block_size: int, namespace: str = "") -> list[BlockKey]:
    """The router's keys of every whole block of a prompt: what prefix_tokens looks up."""
    return block_hashes(token_ids, block_size, KEY_ALGORITHM, KEY_SEED, namespace)


def keys_by_size(token_ids: Sequence[int], namespace: str = "") -> Callable[[int], list[BlockKey]]:
    """block_keys of one prompt at whatever block size is asked, each size hashed once: the
    `keys_for` that prefix_tokens takes."""
    memo: dict[int, list[BlockKey]] = {}

    def keys_for(block_size: int) -> list[BlockKey]:
        keys = memo.get(block_size)
        if keys is None:
            keys = memo[block_size] = block_keys(token_ids, block_size, namespace)
        return keys

    return keys_for


def leading_held(keys: Sequence[BlockKey], held: Container[BlockKey]) -> int:
    """How many of `keys`, from the first, are all in `held` (a contiguous prefix)."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


def chain_keys(
    parent: BlockKey | None, token_ids: Sequence[int], block_size: int, namespace: str = ""
) -> list[BlockKey]:
    """Keys of consecutive whole blocks that follow `parent` (None: the namespace's root)."""
    prev = _ALGO.root(namespace, KEY_SEED) if parent is None else parent
    return _ALGO.chain(prev, token_ids, block_size, KEY_SEED)


@dataclass(slots=True)
class IndexStats:
    """Running counters over all workers (Prometheus counters: they only grow)."""

    events: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    resets: int = 0


class BlockIndex(ABC):
    """Per worker, the blocks it holds. Writers: one subscriber per worker calls `apply` with
    each batch's events in order, and `drop_worker` when it can no longer vouch for the worker
    (an unrecoverable gap, a restart, removal, death). Readers: kv_aware calls `prefix_tokens`.
    A worker is *known* from its first BlockStored until it is dropped (AllBlocksCleared
    empties it but keeps it known); an unknown worker has no entry in prefix_tokens' answer."""

    stats: IndexStats

    @abstractmethod
    def apply(self, worker: WorkerId, events: Iterable[Event]) -> None:
        """Apply one batch of `worker`'s events, in publication order."""

    @abstractmethod
    def drop_worker(self, worker: WorkerId) -> None:
        """Forget everything about `worker`: it is unknown until fresh events arrive."""

    @abstractmethod
    def block_size(self, worker: WorkerId) -> int | None:
        """The block size learned from `worker`'s events; None while it is unknown."""

    @abstractmethod
    def prefix_tokens(
        self, workers: Iterable[WorkerId], keys_for: Callable[[int], Sequence[BlockKey]]
    ) -> dict[WorkerId, int]:
        """For each known worker among `workers`, how many leading tokens of the request it
        holds: its longest contiguous run of `keys_for(its block size)` times the block size.
        `keys_for(n)` must return block_keys(prompt ids, n, request namespace)."""

    @abstractmethod
    def blocks(self) -> dict[WorkerId, int]:
        """Blocks held per known worker (for /metrics, and kv_aware's placement)."""

    def removed_blocks(self, worker: WorkerId) -> int:
        """Blocks `worker` has removed since it became known (BlockRemoved events that hit):
        kv_aware compares it between decisions to tell a worker that is evicting. An index that
        cannot tell (Redis, as the router reads it) answers 0 for all."""
        return 0

    def check_integrity(self) -> None:  # noqa: B027  (a hook: no-op by default)
        """Recount what the index keeps running counts of (nothing to recount by default)."""

    def answering(self) -> bool:
        """False while the index cannot be read at all (its store is down): kv_aware then
        scores every worker from its approximate tree, as cache_aware would."""
        return True


@dataclass(slots=True)
class _Worker:
    block_size: int
    by_engine: dict[EngineHash, BlockKey] = field(default_factory=dict)
    # router key -> engine hashes mapped to it: two engine hashes may key the same tokens
    # (an engine namespace the router does not see), and one removal must not hide the other.
    refs: dict[BlockKey, int] = field(default_factory=dict)

    def add(self, engine_hash: EngineHash, key: BlockKey) -> None:
        old = self.by_engine.get(engine_hash)
        if old == key:
            return
        if old is not None:
            self.discard(engine_hash)
        self.by_engine[engine_hash] = key
        self.refs[key] = self.refs.get(key, 0) + 1

    def discard(self, engine_hash: EngineHash) -> bool:
        key = self.by_engine.pop(engine_hash, None)
        if key is None:
            return False
        left = self.refs[key] - 1
        if left:
            self.refs[key] = left
        else:
            del self.refs[key]
        return True


class InMemoryIndex(BlockIndex):
    """The index in the router's own memory: a dict per worker (about 200 bytes per block;
    benchmarks/kv_router_bench.py measures it)."""

    def __init__(self) -> None:
        self._workers: dict[WorkerId, _Worker] = {}
        self._removed: dict[WorkerId, int] = {}
        self.stats = IndexStats()

    def apply(self, worker: WorkerId, events: Iterable[Event]) -> None:
        for event in events:
            self.stats.events += 1
            if isinstance(event, BlockStored):
                self._store(worker, event)
            elif isinstance(event, BlockRemoved):
                self._remove(worker, event)
            elif isinstance(event, AllBlocksCleared):
                # known and empty, not unknown: the router must expect no hit there at all
                self.stats.cleared += 1
                state = self._workers.get(worker)
                if state is not None:
                    self._workers[worker] = _Worker(state.block_size)

    def drop_worker(self, worker: WorkerId) -> None:
        self._workers.pop(worker, None)
        self._removed.pop(worker, None)

    def block_size(self, worker: WorkerId) -> int | None:
        state = self._workers.get(worker)
        return None if state is None else state.block_size

    def prefix_tokens(
        self, workers: Iterable[WorkerId], keys_for: Callable[[int], Sequence[BlockKey]]
    ) -> dict[WorkerId, int]:
        out: dict[WorkerId, int] = {}
        for worker in workers:
            state = self._workers.get(worker)
            if state is not None:
                out[worker] = (
                    leading_held(keys_for(state.block_size), state.refs) * state.block_size
                )
        return out

    def blocks(self) -> dict[WorkerId, int]:
        return {w: len(s.by_engine) for w, s in self._workers.items()}

    def removed_blocks(self, worker: WorkerId) -> int:
        return self._removed.get(worker, 0)

    def distinct_blocks(self) -> int:
        """Blocks held by at least one worker: the fleet's distinct KV (sum(blocks()) counts a
        block once per worker holding it). A walk of every worker's blocks, for reports."""
        keys: set[BlockKey] = set()
        for state in self._workers.values():
            keys.update(state.refs)
        return len(keys)

    def check_integrity(self) -> None:
        """Recount every worker's key references from its engine-hash map."""
        for worker, state in self._workers.items():
            counts: dict[BlockKey, int] = {}
            for key in state.by_engine.values():
                counts[key] = counts.get(key, 0) + 1
            assert counts == state.refs, f"reference counts of {worker!r} drifted"

    def _store(self, worker: WorkerId, event: BlockStored) -> None:
        if event.medium not in DEVICE_MEDIA or not event.block_hashes:
            return
        size = _learned_block_size(event)
        state = self._workers.get(worker)
        if state is not None and state.block_size != size:
            self.stats.resets += 1
            state = None
        if state is None:
            state = self._workers[worker] = _Worker(size)
        parent = None
        if event.parent_block_hash is not None:
            parent = state.by_engine.get(event.parent_block_hash)
            if parent is None:
                self.stats.orphans += len(event.block_hashes)
                return
        keys = chain_keys(parent, event.token_ids, size, event.namespace)
        for engine_hash, key in zip(event.block_hashes, keys):
            state.add(engine_hash, key)
        self.stats.stored += len(keys)

    def _remove(self, worker: WorkerId, event: BlockRemoved) -> None:
        state = self._workers.get(worker)
        if state is None or event.medium not in DEVICE_MEDIA:
            return
        n = sum(map(state.discard, event.block_hashes))
        if n:
            self.stats.removed += n
            self._removed[worker] = self._removed.get(worker, 0) + n


def _learned_block_size(event: BlockStored) -> int:
    """Tokens per block as the event shows them: its token ids over its hashes when that
    divides evenly (engines that page differently from what they declare), else its field."""
    n, tokens = len(event.block_hashes), len(event.token_ids)
    if tokens and tokens % n == 0:
        return tokens // n
    return event.block_size
