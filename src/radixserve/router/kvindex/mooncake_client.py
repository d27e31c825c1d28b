"""I/O: the router asking Mooncake's master where chained page keys live (`/batch_query_keys` on its
metrics port), with Llumnix's retry and down-gating; the answer is parsed by `metadata`."""

# Llumnix's flags and meanings: a query that fails (refused, timed out, not the documented shape)
# is retried `--kvs-retry-times` times, `--kvs-retry-interval-ms` apart; when every try failed the
# metadata service is down for `--kvs-metadata-service-down-duration-s`, and queries in that
# window return None at once (the caller routes without the store) instead of waiting on it.
# The first query after the window tries again. One outage logs one line.
#
# Transport. `aquery` (the router's, once per routed request) goes through a MasterHttp: the
# router passes its own keep-alive client (proxy/kvs_transport.py), because httpx's AsyncClient
# collapsed under concurrent lookups: 43-96 queries/s against the master at 16 in flight, where
# the router's pool answered 1,000-2,000 on the same machine (benchmarks/kv_mooncake_router_bench.py
# and /work/notes/n8.md). httpx stays the default for tools and tests that build a client alone.

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from radixserve.router.kvindex.gate import KvsGate
from radixserve.router.kvindex.mooncake_meta import (
    NOT_QUERIED,
    KeyLocation,
    parse_batch_query,
    present_prefix,
    query_chunks,
    query_path,
)

log = logging.getLogger("radixserve.router")


@dataclass(frozen=True, slots=True)
class KvsMetadataConfig:
    address: str  # HOST:PORT of mooncake_master's metrics/admin HTTP server
    retry_times: int = 5
    retry_interval_ms: float = 100.0
    down_duration_s: float = 30.0
    timeout_ms: float = 500.0

    def __post_init__(self) -> None:
        if self.retry_times < 0 or self.retry_interval_ms < 0 or self.down_duration_s < 0:
            raise ValueError("kvs retry times, retry interval and down duration must be >= 0")
        if self.timeout_ms <= 0:
            raise ValueError("kvs timeout must be > 0")


class MasterHttp(Protocol):
    """GET on the master's HTTP port: (status, body) within `timeout` seconds; raises
    ConnectionError, OSError or TimeoutError when it cannot."""

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]: ...
    async def aclose(self) -> None: ...


class HttpxMaster:
    """MasterHttp over httpx's AsyncClient (the default where no router passes its own)."""

    def __init__(self, base: str) -> None:
        self.client = httpx.AsyncClient(base_url=base)

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        try:
            resp = await self.client.get(path, timeout=timeout)
        except httpx.HTTPError as exc:
            raise ConnectionError(str(exc) or type(exc).__name__) from None
        return resp.status_code, resp.content

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclass(slots=True)
class MetadataStats:
    queries: int = 0  # answered
    failures: int = 0  # failed tries
    fallbacks: int = 0  # queries that returned None (down, or every try failed)
    seconds: float = 0.0  # total time of answered queries, tries and waits included


class MooncakeMetadataClient:
    """`query` (blocking) and `aquery` (asyncio) return each key's locations, or None."""

    def __init__(
        self,
        config: KvsMetadataConfig,
        clock: Callable[[], float] = time.monotonic,
        transport: MasterHttp | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.gate = KvsGate(config.down_duration_s)
        self._down = False  # an outage logged, not yet over
        self.stats = MetadataStats()
        self.base = f"http://{config.address}"
        self._timeout = config.timeout_ms / 1000
        self._sync: httpx.Client | None = None
        self._async = transport  # aquery's; httpx's (made on first use) when None

    @property
    def up(self) -> bool:
        """False from a failed query until one is answered again."""
        return not self._down

    def query(self, keys: Sequence[str]) -> list[KeyLocation] | None:
        chunks = query_chunks(keys)  # a key that cannot be asked for is the caller's error
        if not self.gate.up(self.clock()):
            self.stats.fallbacks += 1
            return None
        self._sync = self._sync or httpx.Client(base_url=self.base, timeout=self._timeout)
        t0, out = time.perf_counter(), []
        for chunk in chunks:
            locs, error = None, None
            for attempt in range(self.config.retry_times + 1):
                try:
                    locs = parse_batch_query(_body(self._sync.get(query_path(chunk))), chunk)
                    break
                except (httpx.HTTPError, ValueError) as exc:
                    error = exc
                    self.stats.failures += 1
                if attempt < self.config.retry_times:
                    time.sleep(self.config.retry_interval_ms / 1000)
            if locs is None:
                return self._failed(error)
            if self._extend(out, locs, len(keys)):
                break
        return self._answered(out, t0)

    async def aquery(self, keys: Sequence[str]) -> list[KeyLocation] | None:
        chunks = query_chunks(keys)
        if not self.gate.up(self.clock()):
            self.stats.fallbacks += 1
            return None
        self._async = self._async or HttpxMaster(self.base)
        t0, out = time.perf_counter(), []
        for chunk in chunks:
            locs, error = None, None
            for attempt in range(self.config.retry_times + 1):
                try:
                    status, body = await self._async.get(query_path(chunk), self._timeout)
                    if status != 200:
                        raise ValueError(f"/batch_query_keys answered {status}")
                    locs = parse_batch_query(body, chunk)
                    break
                except (ConnectionError, OSError, TimeoutError, ValueError) as exc:
                    error = exc
                    self.stats.failures += 1
                if attempt < self.config.retry_times:
                    await asyncio.sleep(self.config.retry_interval_ms / 1000)
            if locs is None:
                return self._failed(error)
            if self._extend(out, locs, len(keys)):
                break
        return self._answered(out, t0)

    @staticmethod
    def _extend(out: list[KeyLocation], locs: list[KeyLocation], total: int) -> bool:
        """Append one chunk's answer; True (and the rest as NOT_QUERIED) when a key in it is
        held nowhere: no holder's contiguous prefix can reach past it."""
        out.extend(locs)
        if present_prefix(locs) == len(locs) or len(out) == total:
            return False
        out.extend(KeyLocation(False, (), NOT_QUERIED) for _ in range(total - len(out)))
        return True

    def _answered(self, locations: list[KeyLocation], t0: float) -> list[KeyLocation]:
        self.stats.queries += 1
        self.stats.seconds += time.perf_counter() - t0
        self.gate.mark_up()
        if self._down:
            self._down = False
            log.warning("KV metadata service %s is back", self.config.address)
        return locations

    def _failed(self, error: Exception | None) -> None:
        self.stats.fallbacks += 1
        self.gate.mark_down(self.clock())
        if not self._down:
            self._down = True
            log.warning("KV metadata service %s down (%r); routing without it for %.0f s",
                        self.config.address, error, self.config.down_duration_s)  # fmt: skip
        return None

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.aclose()


def _body(resp: httpx.Response) -> bytes:
    resp.raise_for_status()
    return resp.content
