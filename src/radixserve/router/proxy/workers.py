"""The router's workers: registry, health checks, circuit breaker and in-flight load
accounting. The HTTP client that talks to each worker is upstream_pool.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from radixserve.router.policies.base import WorkerView
from radixserve.router.proxy.config import HealthConfig
from radixserve.router.proxy.upstream_pool import (  # noqa: F401  (re-exported: the router's one import place)
    ConnectionPool,
    Headers,
    HttpConnection,
    Response,
    UpstreamError,
    check_url,
)
from radixserve.router.proxy.worker_shapes import WorkerLoad, radixserve_load

log = logging.getLogger("radixserve.router")


class CircuitBreaker:
    """Stops routing to a worker after `failure_threshold` failed requests in a row; after
    `open_secs` it lets one trial request through at a time (half open) and closes after
    `success_threshold` successes."""

    def __init__(self, failure_threshold: int, success_threshold: int, open_secs: float) -> None:
        self.failure_threshold, self.success_threshold = failure_threshold, success_threshold
        self.open_secs, self.trial = open_secs, False
        self.state, self.failures, self.successes, self.open_until = "closed", 0, 0, 0.0

    def allows(self, now: float) -> bool:
        if self.state == "open" and now >= self.open_until:
            self.state, self.successes, self.trial = "half_open", 0, False
        return self.state == "closed" or (self.state == "half_open" and not self.trial)

    def dispatched(self) -> None:
        """A request was sent: while half open it is the one trial."""
        if self.state == "half_open":
            self.trial = True

    def settled(self) -> None:
        """The request sent under dispatched() ended, however it ended."""
        self.trial = False

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self.failures, self.successes = 0, self.successes + 1
            if self.state == "half_open" and self.successes >= self.success_threshold:
                self.state = "closed"
            return
        self.failures, self.successes = self.failures + 1, 0
        tripped = self.failure_threshold > 0 and self.failures >= self.failure_threshold
        if self.state == "half_open" or tripped:
            self.state, self.open_until = "open", now + self.open_secs


@dataclass(eq=False, slots=True)
class Worker:
    """One worker as the router sees it. `load` counts requests in flight through the router."""

    id: str
    url: str
    pool: ConnectionPool
    breaker: CircuitBreaker
    healthy: bool = True  # optimistic: a worker down at start is found out, not waited for
    load: int = 0
    queued_units: int = 0
    probe_failures: int = 0
    probe_successes: int = 0
    addrs: frozenset[tuple[str, int]] = frozenset()
    prefill_tokens: int | None = None  # waiting prefill the worker reported (polled loads)
    reported_at: float = float("-inf")  # when that report was asked for (monotonic)
    kv_load_ratio: float | None = None  # host-tier load time / prefill time per token, reported
    kv_store_load_ratio: float | None = None  # the same from the KV store
    counts: dict[str, int] = field(default_factory=lambda: {"requests": 0, "errors": 0})
    role: str = "neutral"  # Llumnix's instance types: neutral (whole requests), prefill, decode
    bootstrap_port: int | None = None  # a prefill worker's --disaggregation-bootstrap-port

    def view(self, now: float) -> WorkerView:
        routable = self.healthy and (self.breaker.state == "closed" or self.breaker.allows(now))
        return WorkerView(
            self.id,
            self.load,
            routable,
            self.queued_units,
            self.prefill_tokens,
            self.reported_at,
            self.kv_load_ratio,
            self.kv_store_load_ratio,
        )

    def info(self) -> dict[str, object]:
        return {
            "id": self.id,
            "url": self.url,
            "healthy": self.healthy,
            "circuit": self.breaker.state,
            "load": self.load,
            "role": self.role,
            **({"bootstrap_port": self.bootstrap_port} if self.role == "prefill" else {}),
            **self.counts,
        }


async def fan_out(
    workers: list[Worker], method: str, path: str, headers: bytes = b""
) -> list[Response | Exception]:
    """The same request to every worker at once; failures come back as exceptions."""
    calls = (w.pool.request(method, path, timeout=30.0, headers=headers) for w in workers)
    return await asyncio.gather(*calls, return_exceptions=True)


def _normalize(url: str) -> str:
    try:
        return check_url(url)
    except ValueError:
        return url


async def resolve(url: str) -> frozenset[tuple[str, int]]:
    """The (address, port) pairs `url` reaches, so that one worker named two ways (localhost
    and 127.0.0.1) is known as one; empty if the name does not resolve."""
    parts = urlsplit(check_url(url))
    port = parts.port or 80
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            parts.hostname, port, type=socket.SOCK_STREAM
        )
    except OSError:
        return frozenset()
    return frozenset((info[4][0], port) for info in infos)


class DuplicateWorker(ValueError):
    """The worker is registered already (by its url or an address it resolves to)."""


class WorkerRegistry:
    """The fleet. `on_removed(worker_id)` fires when a worker leaves, or fails its health checks
    (a dead engine's KV cache is gone, so what the policy believed it held is stale)."""

    def __init__(self, health: HealthConfig, on_removed: Callable[[str], None]) -> None:
        self.health, self.on_removed = health, on_removed
        self.workers: list[Worker] = []
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self.overloaded: frozenset[str] = frozenset()  # ids past an overload threshold
        self.poll_loads = False  # also read each worker's /get_loads after a good probe
        self.load_reader: Callable[[Worker], Awaitable[None]] | None = None  # instead of that
        self.reported: Callable[[str], Any] | None = None  # worker id -> its load report
        self.auth = b""  # header lines for the workers' keyed endpoints (/get_server_info)

    def add(
        self,
        url: str,
        addrs: frozenset[tuple[str, int]] = frozenset(),
        healthy: bool = True,
        role: str = "neutral",
        bootstrap_port: int | None = None,
    ) -> Worker:
        """Register `url` in `role` (ValueError if malformed or already present, by its url or
        by the addresses it resolved to); routable at once if `healthy`."""
        url = check_url(url)
        same = self.by_url(url) or next((w for w in self.workers if w.addrs & addrs), None)
        if same is not None:
            raise DuplicateWorker(f"worker {url} is already registered (as {same.url})")
        h = self.health
        breaker = CircuitBreaker(
            h.cb_failure_threshold, h.cb_success_threshold, h.cb_timeout_duration_secs
        )
        pool = ConnectionPool(
            url, connect_timeout=h.connect_timeout_secs, max_conns=h.max_worker_connections
        )
        worker = Worker(f"w{next(self._ids)}", url, pool, breaker, healthy, addrs=addrs,
                        role=role, bootstrap_port=bootstrap_port)  # fmt: skip
        self.workers = [*self.workers, worker]  # copy: a running health sweep keeps its list
        log.info("worker %s added: %s (%s)", worker.id, url, role)
        return worker

    def remove(self, worker: Worker) -> None:
        self.workers = [w for w in self.workers if w is not worker]
        worker.pool.close()
        self.on_removed(worker.id)
        log.info("worker %s removed: %s", worker.id, worker.url)

    def get(self, ref: str) -> Worker | None:
        """A worker by id or by url."""
        return next((w for w in self.workers if ref in (w.id, w.url)), None) or self.by_url(ref)

    def by_url(self, url: str) -> Worker | None:
        url = _normalize(url)
        return next((w for w in self.workers if w.url == url), None)

    def views(self, now: float, exclude: Iterable[str] = ()) -> list[WorkerView]:
        views = [w.view(now) for w in self.workers]
        # Overloaded workers are steered away from (when that is everyone, the router sheds).
        off = self.overloaded.union(exclude) if exclude else self.overloaded
        if off:
            views = [WorkerView(v.id, v.load, False) if v.id in off else v for v in views]
        return views

    def routable(self) -> int:
        now = time.monotonic()
        return sum(1 for w in self.workers if w.view(now).healthy)

    # ----- health checks -----

    def start(self) -> None:
        if self.health.health_check_interval_secs > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._health_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for worker in self.workers:
            worker.pool.close()

    async def _health_loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.health.health_check_interval_secs)

    async def check_all(self) -> None:
        """Probe every worker once, concurrently."""
        workers = self.workers
        results = await asyncio.gather(*(self._probe(w) for w in workers))
        for worker, ok in zip(workers, results):
            self._record_probe(worker, ok)
        h = self.health
        if h.overload_waiting_threshold > 0 or h.overload_kv_usage_threshold > 0:
            live = [w for w in workers if w.healthy]
            loads = await asyncio.gather(*(self._load(w) for w in live))
            self.overloaded = frozenset(w.id for w, busy in zip(live, loads) if busy)

    async def _load(self, worker: Worker) -> bool:
        """Whether the worker reports a waiting queue or KV usage past the thresholds (our
        server's /get_server_info "stats"); a worker that does not say is not overloaded."""
        h = self.health
        report = self.reported(worker.id) if self.reported is not None else None
        if report is not None:  # what the worker's kind reports (vLLM's /metrics...)
            waiting, kv = report.waiting, report.kv_usage
        else:
            stats = (await self._get_json(worker, "/get_server_info") or {}).get("stats")
            if not isinstance(stats, dict):
                return False
            waiting, kv = stats.get("num_waiting"), stats.get("kv_usage")
        return (_number(waiting) and 0 < h.overload_waiting_threshold < waiting) or (
            _number(kv) and 0 < h.overload_kv_usage_threshold < kv
        )

    async def _get_json(self, worker: Worker, path: str) -> dict | None:
        """GET `path` within the health timeout, connecting included; its JSON object, or None
        (unreachable, slow, not 200, not a JSON object)."""
        timeout = self.health.health_check_timeout_secs
        try:
            resp = await asyncio.wait_for(
                worker.pool.request("GET", path, timeout=timeout, headers=self.auth), timeout
            )
            obj = json.loads(resp.body) if resp.status == 200 else None
        except (UpstreamError, OSError, asyncio.TimeoutError, ValueError):
            return None
        return obj if isinstance(obj, dict) else None

    async def probe_now(self, worker: Worker) -> bool:
        """One probe whose verdict counts at once (a worker just added)."""
        ok = await self._probe(worker)
        worker.healthy = ok
        return ok

    async def recheck(self, worker: Worker) -> None:
        """One probe now, for a worker a request just failed on: a failed one takes the worker
        out at once (as failing its health checks would); a passed one changes nothing."""
        if not worker.healthy or await self._probe(worker):
            return
        if worker.healthy and worker in self.workers:  # not taken out while it was probed
            worker.healthy, worker.probe_failures, worker.probe_successes = False, 1, 0
            self.on_removed(worker.id)
            log.warning("worker %s (%s) failed a request and a probe", worker.id, worker.url)

    async def _probe(self, worker: Worker) -> bool:
        # The whole probe, connecting included, is bounded: one host that drops packets must
        # not hold up the verdict on the others.
        timeout = self.health.health_check_timeout_secs
        try:
            resp = await asyncio.wait_for(
                worker.pool.request("GET", self.health.health_check_endpoint, timeout=timeout),
                timeout,
            )
        except (UpstreamError, OSError, asyncio.TimeoutError):
            return False
        if resp.status == 200 and self.poll_loads:
            await (self.load_reader or self.poll_load)(worker)
        return resp.status == 200

    async def poll_load(self, worker: Worker) -> None:
        """Read the prefill tokens `worker` has waiting from its /get_loads. The report is
        stamped with the time it was asked for: dispatches made before then are in it. A worker
        that does not report (another engine, an error) keeps the router's own count alone."""
        asked = time.monotonic()
        loads = await self._get_json(worker, "/get_loads") or {}
        tokens = loads.get("waiting_prefill_tokens")
        ok = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
        worker.prefill_tokens, worker.reported_at = (tokens, asked) if ok else (None, float("-inf"))
        # what loading a token from its host tier or the store costs against prefilling one
        reported = radixserve_load(loads) or WorkerLoad()
        worker.kv_load_ratio = reported.kv_load_ratio
        worker.kv_store_load_ratio = reported.kv_store_load_ratio

    def _record_probe(self, worker: Worker, ok: bool) -> None:
        h = self.health
        if ok:
            worker.probe_failures, worker.probe_successes = 0, worker.probe_successes + 1
            if not worker.healthy and worker.probe_successes >= h.health_success_threshold:
                worker.healthy = True
                log.warning("worker %s (%s) is healthy again", worker.id, worker.url)
            return
        worker.probe_failures, worker.probe_successes = worker.probe_failures + 1, 0
        if worker.healthy and worker.probe_failures >= h.health_failure_threshold:
            worker.healthy = False
            self.on_removed(worker.id)
            log.warning("worker %s (%s) failed its health checks", worker.id, worker.url)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
