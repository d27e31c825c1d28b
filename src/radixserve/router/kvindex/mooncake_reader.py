"""What a router reads from Mooncake Store's master (`route --kv-index mooncake://HOST:PORT`,
Llumnix's KVS lookup): per routed request, the prompt's store keys computed from its token ids,
ONE batch query (mooncake_client: retry and down-gating), each key's replicas mapped to the
workers that can load it, and each worker's longest contiguous prefix, in tokens. A TierSource
for kv_aware, whose device holdings still come from the workers' KV events."""

# Which worker loads what. Each engine says in /get_server_info which store segment it holds
# (`kv_store.segment`: its transport endpoint, null when it mounts none) and the namespace digest
# its keys start with (`kv_store.namespace`); `register` records both. A replica on a worker's
# own segment is loadable by that worker; a replica on any segment no registered worker claims is
# the store process's (`radixserve kv-store`), which every worker reads. A worker that restarts
# keeps counting what the store process holds: the keys outlive it. A tensor-parallel engine
# stores each page as one value per rank, its key suffixed with the KV heads it holds
# (`kv_store.key_parts`: `h0-4`, `h4-8`); its pages are looked up part by part, and a chunk
# counts as loadable only where every part is.
#
# Why the query happens before `select`, outside the policy: it is I/O and the policy is pure.
# The router awaits `prepare`, then calls `select` in the same synchronous stretch, which reads
# the answer through `loadable_tokens`; no await falls between them, so concurrent requests
# cannot mix their answers.

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from radixserve.router.kvindex.mooncake_client import (
    KvsMetadataConfig,
    MasterHttp,
    MooncakeMetadataClient,
)
from radixserve.router.kvindex.mooncake_meta import loadable_prefix, store_keys
from radixserve.router.kvindex.tiers import KeysFor, TierSource

log = logging.getLogger("radixserve.router")


@dataclass(frozen=True, slots=True)
class MooncakeIndexConfig:
    """The router's Mooncake settings (RouterConfig's kvs_* fields; Llumnix's names)."""

    address: str  # HOST:PORT of the master's metrics/HTTP port (serves /batch_query_keys)
    hash_algo: str = "sha256_cbor"
    chunk_size: int = 256
    seed: int = 0
    save_unfull_chunk: bool = False
    retry_times: int = 5
    retry_interval_ms: float = 100.0
    down_duration_s: float = 30.0
    timeout_ms: float = 500.0
    min_tokens: int = 0  # shorter prompts are not looked up (the policy ignores their prefix)


@dataclass(frozen=True, slots=True)
class StoreWorker:
    segment: str | None  # transport endpoint of the segment the worker holds; None: none
    namespace: str  # digest its keys start with
    parts: tuple[str, ...] = ()  # a tensor-parallel engine's key suffixes, one per rank


class MooncakeStoreReader(TierSource):
    """`prepare` asks the master about one request; `loadable_tokens` answers from that."""

    name = "store"

    def __init__(self, config: MooncakeIndexConfig, transport: MasterHttp | None = None) -> None:
        """``transport``: how lookups reach the master (the router passes its own pooled
        client; None: httpx)."""
        self.config = config
        self.client = MooncakeMetadataClient(
            KvsMetadataConfig(
                config.address,
                config.retry_times,
                config.retry_interval_ms,
                config.down_duration_s,
                config.timeout_ms,
            ),
            transport=transport,
        )
        self.workers: dict[Hashable, StoreWorker] = {}
        self.answer: dict[Hashable, int] | None = {}  # None: the master did not answer
        self.skipped = 0  # requests not looked up (short, untokenized, no registered worker)

    # -- workers -------------------------------------------------------------------------------
    def register(self, worker: Hashable, info: dict[str, object] | None) -> bool:
        """Record what `worker` says of the store in its server info (`kv_store`: segment,
        namespace, and the chunk size, hash algorithm and seed it writes with, which must be the
        router's). False when it writes no keys the router can compute."""
        store = (info or {}).get("kv_store")
        if not isinstance(store, dict) or not isinstance(store.get("namespace"), str):
            self.workers.pop(worker, None)
            return False
        cfg = self.config
        theirs = {k: store.get(k) for k in ("chunk_size", "hash_algo", "seed")}
        ours = {"chunk_size": cfg.chunk_size, "hash_algo": cfg.hash_algo, "seed": cfg.seed}
        differ = {k: v for k, v in theirs.items() if v is not None and v != ours[k]}
        if differ:
            log.warning("worker %s writes store keys with %s, the router computes %s: its store "
                        "holdings are not counted", worker, differ, ours)  # fmt: skip
            self.workers.pop(worker, None)
            return False
        segment = store.get("segment")
        parts = store.get("key_parts") or ()
        self.workers[worker] = StoreWorker(
            segment if isinstance(segment, str) and segment else None, store["namespace"],
            tuple(str(p) for p in parts),
        )  # fmt: skip
        return True

    def forget(self, worker: Hashable) -> None:
        self.workers.pop(worker, None)

    # -- one request ---------------------------------------------------------------------------
    async def prepare(self, token_ids: Sequence[int] | None, namespace: str = "") -> None:
        """Ask the master where the prompt's chunks live (one batch query; several bounded
        requests for very long prompts); leave the answer None while it is down."""
        self.answer = {}
        cfg = self.config
        if not token_ids or len(token_ids) < max(cfg.min_tokens, 1) or not self.workers:
            self.skipped += 1
            return
        groups: dict[tuple[str, tuple[str, ...]], dict[Hashable, str | None]] = {}
        for wid, w in self.workers.items():
            groups.setdefault((w.namespace, w.parts), {})[wid] = w.segment
        keys: list[str] = []
        spans: list[tuple[tuple[str, tuple[str, ...]], int, int]] = []
        for group in groups:
            ks = store_keys(token_ids, group[0], cfg.chunk_size, cfg.hash_algo, cfg.seed,
                            namespace or None, cfg.save_unfull_chunk)  # fmt: skip
            for part in group[1] or ("",):  # one run of keys per rank's part
                spans.append((group, len(keys), len(keys) + len(ks)))
                keys.extend([f"{k}_{part}" for k in ks] if part else ks)
        if not keys:  # shorter than one chunk
            return
        locations = await self.client.aquery(keys)
        if locations is None:
            self.answer = None
            return
        claimed = {w.segment for w in self.workers.values() if w.segment}
        shared = {r.endpoint for loc in locations for r in loc.replicas} - claimed
        chunks: dict[Hashable, int] = {}
        for group, lo, hi in spans:  # a chunk is loadable where every part of it is
            for wid, n in loadable_prefix(locations[lo:hi], groups[group], shared).items():
                chunks[wid] = min(n, chunks.get(wid, n))
        self.answer = {wid: min(n * cfg.chunk_size, len(token_ids))
                       for wid, n in chunks.items() if n}  # fmt: skip

    def loadable_tokens(
        self, workers: Iterable[Hashable], keys_for: KeysFor | None = None
    ) -> dict[Hashable, int] | None:
        if self.answer is None:
            return None
        return {w: self.answer[w] for w in workers if w in self.answer}

    # -- what the proxy shows ------------------------------------------------------------------
    @property
    def lookups(self) -> int:
        return self.client.stats.queries

    @property
    def lookup_seconds(self) -> float:
        return self.client.stats.seconds

    def metric_samples(self) -> list[tuple[str, str, str, float]]:
        """(name, kind, help, value) for the router's /metrics (the lookup time is a summary
        of `lookups` and `lookup_seconds`, which the collector reads itself)."""
        s, gate = self.client.stats, self.client.gate
        up = int(gate.up(time.monotonic()) and self.client.up)
        return [
            ("kvs_up", "gauge", "1: lookups go to Mooncake's master; 0: marked down", up),
            ("kvs_lookups_total", "counter", "lookups the master answered", s.queries),
            ("kvs_lookup_failures_total", "counter", "failed lookup attempts", s.failures),
            ("kvs_down_total", "counter", "times the service was marked down", gate.times_down),
            ("kvs_fallback_decisions_total", "counter", "decisions made without the master",
             s.fallbacks),
            ("kvs_workers", "gauge", "workers whose store keys the router computes",
             len(self.workers)),
        ]  # fmt: skip

    async def close(self) -> None:
        await self.client.aclose()
