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
#
# Media (issue 28). A BlockStored's `medium` says which pool holds the blocks (vLLM's names:
# "GPU" for the engine's own pool, "CPU" for its host offload tier; see DEVICE_MEDIA). Device
# blocks are what prefix_tokens counts. Blocks on any other medium are kept apart, per worker
# and per medium (one block may sit on several), and answer lower_tokens: the leading prompt
# tokens a worker holds on device or can load from that medium, which kv_aware prices at the
# worker's load-to-prefill ratio (kvindex/tiers.py's HostTier). vLLM's CPU offloading announces
# an offloaded block by its hash alone (no token ids): it is keyed by the device block of the
# same hash, which it was copied from while still held there. AllBlocksCleared is the device
# pool's (vLLM's prefix-cache reset) and leaves the lower media as they are; drop_worker
# forgets them all.

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
    counts_removals = False
    """Whether removed_blocks() counts (else it answers 0 for every worker)."""

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

    def lower_tokens(
        self, workers: Iterable[WorkerId], keys_for: Callable[[int], Sequence[BlockKey]]
    ) -> dict[WorkerId, int]:
        """For each worker among `workers` holding blocks on a lower medium (host memory,
        disk), the leading prompt tokens it holds on device or can load from one such medium
        (the most over its media). An index that keeps no lower media answers {}."""
        return {}

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


class _Either:
    """Keys held in either of two sets (device blocks count towards a lower-tier run)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[BlockKey], b: Container[BlockKey]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


def lower_medium(medium: str | None) -> str | None:
    """The name a medium is kept under: None for the engine's own (device) pool."""
    return None if medium in DEVICE_MEDIA else str(medium).upper()


class InMemoryIndex(BlockIndex):
    """The index in the router's own memory: a dict per worker (about 200 bytes per block;
    benchmarks/kv_router_bench.py measures it)."""

    counts_removals = True

    def __init__(self) -> None:
        self._workers: dict[WorkerId, _Worker] = {}
        self._lower: dict[WorkerId, dict[str, _Worker]] = {}  # worker -> medium -> its blocks
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
        self._lower.pop(worker, None)

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

    def lower_blocks(self) -> dict[WorkerId, dict[str, int]]:
        """Blocks held per worker on each lower medium (for /metrics and tests)."""
        return {w: {m: len(s.by_engine) for m, s in media.items()}
                for w, media in self._lower.items()}  # fmt: skip

    def lower_tokens(
        self, workers: Iterable[WorkerId], keys_for: Callable[[int], Sequence[BlockKey]]
    ) -> dict[WorkerId, int]:
        out: dict[WorkerId, int] = {}
        for worker in workers:
            best = 0
            device = self._workers.get(worker)
            for state in self._lower.get(worker, {}).values():
                held: Container[BlockKey] = state.refs
                if device is not None and device.block_size == state.block_size:
                    held = _Either(state.refs, device.refs)
                best = max(best, leading_held(keys_for(state.block_size), held) * state.block_size)
            if best:
                out[worker] = best
        return out

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
        """Recount every worker's key references (each medium's) from its engine-hash map."""
        states = [(w, s) for w, s in self._workers.items()]
        states += [((w, m), s) for w, media in self._lower.items() for m, s in media.items()]
        for worker, state in states:
            counts: dict[BlockKey, int] = {}
            for key in state.by_engine.values():
                counts[key] = counts.get(key, 0) + 1
            assert counts == state.refs, f"reference counts of {worker!r} drifted"

    def _store(self, worker: WorkerId, event: BlockStored) -> None:
        if not event.block_hashes:
            return
        medium = lower_medium(event.medium)
        if medium is not None:
            self._store_lower(worker, medium, event)
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

    def _store_lower(self, worker: WorkerId, medium: str, event: BlockStored) -> None:
        """Blocks entering a lower medium: keyed from their token ids and parent (the parent
        may be found on that medium or on device), or, announced by hash alone, by the device
        block of the same hash they were copied from."""
        size = _learned_block_size(event) if event.token_ids else event.block_size
        media = self._lower.setdefault(worker, {})
        state = media.get(medium)
        if state is not None and state.block_size != size:
            self.stats.resets += 1
            state = None
        if state is None:
            state = media[medium] = _Worker(size)
        device = self._workers.get(worker)
        if device is not None and device.block_size != size:
            device = None
        if event.token_ids:
            parent = None
            if event.parent_block_hash is not None:
                parent = _lookup(event.parent_block_hash, state, device)
                if parent is None:
                    self.stats.orphans += len(event.block_hashes)
                    return
            keys: list[BlockKey | None] = list(
                chain_keys(parent, event.token_ids, size, event.namespace)
            )
        else:
            keys = [_lookup(h, None, device) for h in event.block_hashes]
        for engine_hash, key in zip(event.block_hashes, keys):
            if key is None:
                self.stats.orphans += 1
            else:
                state.add(engine_hash, key)
                self.stats.stored += 1

    def _remove(self, worker: WorkerId, event: BlockRemoved) -> None:
        medium = lower_medium(event.medium)
        if medium is not None:
            lower = self._lower.get(worker, {}).get(medium)
            if lower is not None:
                self.stats.removed += sum(map(lower.discard, event.block_hashes))
            return
        state = self._workers.get(worker)
        if state is None:
            return
        n = sum(map(state.discard, event.block_hashes))
        if n:
            self.stats.removed += n
            self._removed[worker] = self._removed.get(worker, 0) + n


def _lookup(engine_hash: EngineHash, *states: _Worker | None) -> BlockKey | None:
    """The router key of `engine_hash` in the first of `states` that maps it."""
    for state in states:
        if state is not None:
            key = state.by_engine.get(engine_hash)
            if key is not None:
                return key
    return None


def _learned_block_size(event: BlockStored) -> int:
    """Tokens per block as the event shows them: its token ids over its hashes when that
    divides evenly (engines that page differently from what they declare), else its field."""
    n, tokens = len(event.block_hashes), len(event.token_ids)
    if tokens and tokens % n == 0:
        return tokens // n
    return event.block_size
