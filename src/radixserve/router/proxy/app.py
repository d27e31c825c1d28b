"""The router's HTTP face: an asyncio + httptools server that proxies inference to workers
(streams passed through as they arrive), retries failures elsewhere, and serves admin and metrics.
This module owns the Router's state, its workers' admission and its background work; the
inference path is proxy/forwarding.py, the admin API proxy/admin.py.

Why not a framework: on a 2-core VM, aiohttp's server and client together cost more CPU per
request than the 4 workers behind the router; see benchmarks/router_bench.py for the numbers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from radixserve.router.policies.registry import create_policy
from radixserve.router.proxy.admin import INFERENCE, Endpoints, Handler
from radixserve.router.proxy.admission import Admission
from radixserve.router.proxy.config import RouterConfig
from radixserve.router.proxy.connections import ClientConn, Request
from radixserve.router.proxy.errors import error_for
from radixserve.router.proxy.forwarding import Forwarding
from radixserve.router.proxy.kv_setup import KvRouting, open_kv_index
from radixserve.router.proxy.metrics import BUCKETS, metrics_registry
from radixserve.router.proxy.worker_kinds import WorkerKinds, http_get
from radixserve.router.proxy.workers import Worker, WorkerRegistry, check_url, resolve
from radixserve.tracing import open_tracer

log = logging.getLogger("radixserve.router")


class Router(Forwarding, Endpoints):
    """The router: its registry, policy, metrics and HTTP endpoints."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        # Redis (the optional extra) is imported only for --kv-index redis://
        self.kvs, self.policy = open_kv_index(config, self._worker_id)
        if self.kvs is None:
            self.policy = create_policy(config.policy, config.cache_policy)
        self.policy.defer_eviction = True  # off the dispatch path: see _evict_in_slices
        self._evicting: asyncio.Task[None] | None = None
        self.pd = None
        if config.pd_disaggregation:
            from radixserve.router.proxy.pd import PdDispatch

            self.pd = PdDispatch(self)
        self.registry = WorkerRegistry(config.health, self._worker_removed)
        # kv_aware: an index fed by the workers' KV events, prompts tokenized as they do
        has_index = self.policy.index is not None
        # on Redis the kv-indexer follows the events; on Mooncake the router does, as in memory
        subscribe = self.kvs is None or self.policy.index is not self.kvs
        store = self.kvs if self.kvs is not None and subscribe else None
        self.kv = KvRouting(self.policy, config.tokenizer, subscribe, store) if has_index else None
        # kv_aware: long prompts are tokenized in these threads, never on the event loop
        workers = config.tokenize_workers if self.kv is not None else 0
        self._tokenizing = (
            ThreadPoolExecutor(workers, thread_name_prefix="router-tokenize") if workers else None
        )
        self._timeout_said = float("-inf")
        self.registry.poll_loads = True  # _read_load asks each kind for its own load report
        self.registry.load_reader = self._read_load
        overrides = {check_url(u): src for u, src in config.kv_event_overrides().items()}
        self.kinds = WorkerKinds(config.worker_type, overrides)
        self.registry.reported = self.kinds.reported  # overload thresholds read these first
        self.registry.auth = self._worker_auth()
        self._admitting: set[asyncio.Task[bool]] = set()
        self.retries, self.failed = 0, {502: 0, 503: 0, 504: 0}
        self.decisions = [0] * (len(BUCKETS) + 1)
        self.decision_sum = 0.0
        self.connections = 0
        self.admission = Admission(
            config.max_concurrent_requests, config.queue_size, config.queue_timeout_secs
        )
        self.server: asyncio.AbstractServer | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.routes: dict[str, dict[str, Handler]] = {}
        self.add_routes()
        self.metrics_registry = metrics_registry(self)
        self.tracer = open_tracer(config.trace, "radixserve-router")

    async def start(self) -> int:
        """Listen and start background work; returns the bound port. Unreachable workers do not
        delay this: health checks and the circuit breaker find them out."""
        for url in self.config.worker_urls:
            worker = self.registry.add(url, await resolve(url))
            self.kinds.register(worker.id, worker.url)
            self.admit_later(worker)  # in the background: an unreachable worker delays nothing
        if self.pd is not None:
            await self.pd.add_configured()
        self.registry.start()
        if self.config.cache_policy.eviction_interval_secs > 0:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        self.server = await asyncio.get_running_loop().create_server(
            lambda: ClientConn(self), self.config.host, self.config.port, backlog=4096
        )
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in (self._ticker, self._evicting, *self._admitting):
            if task is not None:
                task.cancel()
        if self.kv is not None:
            await self.kv.stop()
        await self.registry.stop()
        if self.kvs is not None:
            await self.kvs.close()
        if self._tokenizing is not None:
            self._tokenizing.shutdown(wait=False, cancel_futures=True)
        if self.tracer is not None:
            self.tracer.close()

    def _worker_removed(self, worker_id: str) -> None:
        self.policy.on_worker_removed(worker_id)
        if self.pd is not None:
            self.pd.decode_policy.on_worker_removed(worker_id)

    def _worker_id(self, url: str) -> str | None:
        worker = self.registry.by_url(url)
        return None if worker is None else worker.id

    def admit_later(self, worker: Worker) -> None:
        """admit(worker) in the background, waiting for the worker to answer first."""
        task = asyncio.get_running_loop().create_task(self.admit(worker, wait=True))
        self._admitting.add(task)
        task.add_done_callback(self._admitting.discard)

    async def admit(self, worker: Worker, wait: bool = False) -> bool:
        """Recognise the worker's kind (`wait`: until it answers); then, with kv_aware, check
        its tokenizer and subscribe to its KV events; a worker that tokenizes differently is
        removed (False)."""
        get = http_get(worker.pool.request, self._worker_auth())
        if self.kv is not None:  # otherwise recognised when first needed (a load read, a flush)
            while await self.kinds.identify(worker.id, worker.url, get) is None and wait:
                await asyncio.sleep(self.config.health.health_check_interval_secs or 2.0)
        if self.kv is None or not self.kv.subscribe:
            why = "on Redis: `radixserve kv-indexer` follows them" if self.kv else "policy "
            self.kinds.not_following(worker.id, worker.url, why if self.kv else
                                     why + self.config.policy + " does not read KV events")  # fmt: skip
        if self.kv is None or worker.role == "decode":  # a decode worker's prefixes route nothing
            return True
        fetch = self.kinds.adapter(worker.id, worker.url, get)
        kind = await self.kinds.identify(worker.id, worker.url, get)
        if await self.kv.admit(worker.id, worker.url, fetch, kind):
            return True
        self.registry.remove(worker)
        self.kinds.forget(worker.id)
        return False

    async def _read_load(self, worker: Worker) -> None:
        """After a good probe: the worker's own load report, by kind (vLLM's /metrics,
        SGLang's /v1/loads, ours /get_loads); its waiting prefill tokens go to the policy."""
        get = http_get(
            worker.pool.request, self._worker_auth(), self.config.health.health_check_timeout_secs
        )
        kind = await self.kinds.identify(worker.id, worker.url, get)
        if kind is None or (kind == "radixserve" and self.kv is None):
            return  # ours only matter to kv_aware's pending-prefill accounting
        load = await self.kinds.read_load(worker.id, worker.url, get)
        tokens = None if load is None else load.waiting_prefill_tokens
        at = self.kinds.state(worker.id).load_at
        worker.prefill_tokens, worker.reported_at = (
            (tokens, at) if tokens is not None else (None, float("-inf"))
        )
        # ours: what loading a token from a lower tier costs against prefilling one
        worker.kv_load_ratio, worker.kv_store_load_ratio = self.kinds.load_ratios(worker.id)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.cache_policy.eviction_interval_secs)
            self.policy.tick(time.monotonic())
            self._maybe_evict()

    def _maybe_evict(self) -> None:
        if self.policy.evict_due and self._evicting is None:
            self._evicting = asyncio.get_running_loop().create_task(self._evict_in_slices())

    async def _evict_in_slices(self) -> None:
        """Trim the prefix tree a slice at a time, letting requests through between slices
        (a whole-tree walk at once stalled every request behind it: 32-36 ms at 8,000 chars)."""
        try:
            for _ in self.policy.eviction_slices():
                await asyncio.sleep(0)
        finally:
            self._evicting = None

    # ----- dispatch -----

    async def handle(self, conn: ClientConn, req: Request) -> None:
        """Answer one request; never raises (a handler bug becomes a 500 with an error body, or
        an error event that ends a stream already under way)."""
        try:  # inference inline: each coroutine layer costs requests/s
            if req.path in INFERENCE and req.method == "POST":
                if self._authorized(req, self.config.api_key, conn):
                    adm = self.admission
                    if adm.try_acquire() or await adm.acquire():
                        try:
                            await self.proxy(conn, req)
                        finally:
                            adm.release()
                    else:
                        self._overloaded(conn, req)
            else:
                await self.answer_admin(conn, req)
        except Exception:
            log.exception("error while answering %s %s (request %s)", req.method, req.path,
                          req.rid)  # fmt: skip
            if conn.streaming:
                conn.abort_stream(500, "internal router error", False, req.path)
            else:
                body = error_for(req.path, 500, "internal router error")
                conn.send_json(500, body, keep_alive=False)

    @staticmethod
    def _authorized(req: Request, key: str | None, conn: ClientConn) -> bool:
        if key is None or hmac.compare_digest(req.auth, b"Bearer " + key.encode()):
            return True
        msg = "missing or wrong API key"
        conn.send_json(401, error_for(req.path, 401, msg, "authentication_error"))
        return False
