"""The router's HTTP face: an asyncio + httptools server that proxies inference to workers
(streams passed through as they arrive), retries failures elsewhere, and serves admin and metrics.

Why not a framework: on a 2-core VM, aiohttp's server and client together cost more CPU per
request than the 4 workers behind the router; see benchmarks/router_bench.py for the numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import random
import time
from bisect import bisect_left
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from radixserve.router.policies.base import NoWorkerAvailable, RequestView
from radixserve.router.policies.registry import create_policy
from radixserve.router.policies.tree_keys import units
from radixserve.router.proxy.admin import INFERENCE, Endpoints, Handler
from radixserve.router.proxy.admission import Admission
from radixserve.router.proxy.config import RouterConfig
from radixserve.router.proxy.connections import ClientConn, Request, passback
from radixserve.router.proxy.errors import error_for
from radixserve.router.proxy.kv_setup import KvRouting, open_kv_index
from radixserve.router.proxy.metrics import BUCKETS, metrics_registry
from radixserve.router.proxy.request_body import request_view, routed_payload
from radixserve.router.proxy.route_trace import RouteTrace
from radixserve.router.proxy.worker_kinds import WorkerKinds, http_get
from radixserve.router.proxy.workers import (
    Headers,
    UpstreamError,
    Worker,
    WorkerRegistry,
    check_url,
    resolve,
)
from radixserve.tracing import open_tracer

try:  # 5x faster on long prompts; the stdlib parser is the fallback
    from orjson import loads
except ImportError:  # pragma: no cover
    from json import loads

log = logging.getLogger("radixserve.router")

RETRYABLE = frozenset({502, 503, 504})  # a 500 may be the request's own fault: not retried
PARSE_INLINE = 1 << 20  # bodies above this are parsed in a thread, not on the event loop
TOKENIZE_INLINE = 1024
"""kv_aware: bodies up to this many bytes are tokenized on the event loop (a few hundred
microseconds at most: less than handing them to a thread and back under load); longer ones in
the tokenizing threads (--tokenize-workers)."""
TOKENIZE_TIMEOUT_SECS = 5.0
"""A prompt the tokenizing threads have not tokenized by then is routed without its token ids
(kv_aware's approximate tree) and counted in kv_tokenize_timeouts_total: a stuck tokenizer
delays a request this long at most, never for ever."""


class Router(Endpoints):
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

    # ----- proxying -----

    def _overloaded(self, conn: ClientConn, req: Request) -> None:
        """No slot and no room in the queue."""
        a = self.admission
        msg = f"the router is at capacity ({a.active} in flight, {a.queued} queued)"
        self._shed(conn, req, msg)

    def _shed(self, conn: ClientConn, req: Request, msg: str) -> None:
        """A 503 the client can retry: the router, or every worker, is at capacity."""
        self.failed[503] += 1
        body = error_for(req.path, 503, msg, "service_unavailable", "overloaded")
        conn.send_json(503, body, headers=b"Retry-After: 1\r\n")

    async def proxy(self, conn: ClientConn, req: Request) -> None:
        """Route, forward and relay one inference request, retrying elsewhere while nothing
        has reached the client yet and the failure is one worth retrying."""
        if self.pd is not None:
            return await self.pd.proxy(conn, req)
        try:
            view = await self._request_view(req.body, req.path)
        except (ValueError, TypeError, AttributeError) as exc:
            msg = f"request body is not a JSON object: {exc}"
            conn.send_json(400, error_for(req.path, 400, msg))
            return
        if req.session:
            view = dataclasses.replace(view, routing_key=req.session)
        trace = None if self.tracer is None else RouteTrace(self.tracer, req, self.config.policy)
        try:
            await self._route(conn, req, view, trace)
        finally:
            if trace is not None:
                trace.finish()

    async def _route(
        self, conn: ClientConn, req: Request, view: RequestView, trace: RouteTrace | None
    ) -> None:
        tried: list[str] = []
        lost = 0
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self.retries += 1
                await asyncio.sleep(self._backoff(attempt))
            if trace is not None:
                trace.picking()
            if self.kvs is not None:  # the shared index's answer, read by select just below
                await self.kvs.prepare(view.token_ids, view.kv_namespace)
            worker = self.pick(view, tried)
            if worker is None:
                break
            if trace is not None:
                trace.picked()
            failure = await self.attempt(conn, req, worker, view, trace, attempt)
            if failure is None:
                return
            tried.append(worker.id)
            log.warning("request %s: attempt %d on %s failed: %s", req.rid, attempt + 1,
                        worker.url, failure.why)  # fmt: skip
            lost += failure.lost
            if not failure.retry or lost > 1:  # a request that killed a worker kills no more
                break
        status = self.fail(conn, req, tried, failure.status if tried else 503)
        if trace is not None:
            trace.refused(status)

    async def _request_view(self, body: bytes, path: str = "") -> RequestView:
        """The routing view of a request body; with kv_aware, the prompt's token ids too.
        Long prompts are tokenized in the tokenizing threads while the loop serves other
        requests (the tokenizer releases the GIL), big bodies parsed in a thread; a tokenizer
        error or timeout leaves the view without token ids (the worker says what is wrong)."""
        kv, pool = self.kv, self._tokenizing
        if kv is not None and kv.tokenizer is not None and pool is not None:
            if len(body) > TOKENIZE_INLINE:
                job = asyncio.get_running_loop().run_in_executor(
                    pool, self._parse, body, True, path
                )
                try:
                    view, failed = await asyncio.wait_for(job, TOKENIZE_TIMEOUT_SECS)
                except TimeoutError:
                    kv.tokenize_timeouts += 1
                    if kv.tokenize_timeouts == 1 or time.monotonic() - self._timeout_said > 60:
                        self._timeout_said = time.monotonic()  # said at most once a minute
                        log.warning("tokenizing a prompt of %d bytes took over %.0f s (%d so "
                                    "far): routed without its token ids", len(body),
                                    TOKENIZE_TIMEOUT_SECS, kv.tokenize_timeouts)  # fmt: skip
                    view, failed = await self._parsed(body, False, path)
                kv.tokenize_errors += failed
                return view
        view, failed = await self._parsed(body, True, path)
        if kv is not None:
            kv.tokenize_errors += failed
        return view

    async def _parsed(self, body: bytes, tokenize: bool, path: str) -> tuple[RequestView, bool]:
        """_parse on the loop, or in a thread for a big body."""
        if len(body) > PARSE_INLINE:
            return await asyncio.to_thread(self._parse, body, tokenize, path)
        return self._parse(body, tokenize, path)

    def _parse(self, body: bytes, tokenize: bool, path: str = "") -> tuple[RequestView, bool]:
        """(the routing view of a request body sent to `path`, with kv_aware and `tokenize` the
        prompt's token ids; whether the tokenizer failed). Changes no state: it runs in threads
        too. A /v1/messages body is read as the chat it renders as; it is forwarded as sent."""
        payload = routed_payload(loads(body), path)
        view = request_view(payload)
        if self.kv is None or not tokenize:
            return view, False
        return self.kv.tokenized(payload, view)

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with up to 50% jitter on top, so that retries of many requests
        failed at once do not arrive together."""
        cfg = self.config
        base = min(cfg.retry_backoff_ms * 2 ** (attempt - 1), cfg.retry_max_backoff_ms) / 1000
        return base * (1.0 + 0.5 * random.random())

    def fail(self, conn: ClientConn, req: Request, tried: list[str], status: int) -> int:
        """Answer a request no worker served; returns the status sent."""
        if tried:
            msg = f"request failed on {len(tried)} attempt(s) ({', '.join(tried)})"
        elif self.registry.overloaded and self.registry.routable():
            msg = "every worker reports a queue or KV usage past the overload threshold"
            self._shed(conn, req, msg)
            return 503
        else:
            status, msg = 503, "no healthy worker available"
        self.failed[status] = self.failed.get(status, 0) + 1
        conn.send_json(status, error_for(req.path, status, msg, "service_unavailable"))
        return status

    def pick(self, view: RequestView, tried: list[str]) -> Worker | None:
        """The policy's choice, avoiding workers this request already failed on while others
        are left; the decision time is recorded."""
        now, t0 = time.monotonic(), time.perf_counter()
        workers = self.registry.workers
        try:
            index = self.policy.select(self.registry.views(now, tried), view, now)
        except NoWorkerAvailable:
            if not tried:
                return None
            try:  # every routable worker failed once already: let them try again
                index = self.policy.select(self.registry.views(now), view, now)
            except NoWorkerAvailable:
                return None
        elapsed = time.perf_counter() - t0
        self.decisions[bisect_left(BUCKETS, elapsed)] += 1
        self.decision_sum += elapsed
        return workers[index]

    def _worker_auth(self) -> bytes:
        """The header line the router's own calls to the workers' keyed endpoints carry."""
        key = self.config.worker_api_key
        return b"Authorization: Bearer " + key.encode() + b"\r\n" if key is not None else b""

    def _forward_headers(self, req: Request) -> bytes:
        key = self.config.worker_api_key
        auth = b"Bearer " + key.encode() if key is not None else req.auth
        head = b"X-Request-Id: " + req.rid.encode() + b"\r\n"
        if req.trace and self.tracer is None:  # not tracing: the client's trace passes through
            head += b"traceparent: " + req.trace + b"\r\n"
        return head + (b"Authorization: " + auth + b"\r\n" if auth else b"")

    async def attempt(
        self, conn: ClientConn, req: Request, worker: Worker, view: RequestView,
        trace: RouteTrace | None = None, number: int = 0,
    ) -> Failure | None:  # fmt: skip
        """One try on `worker`: None when the client got its answer, else why it failed."""
        size, cfg = units(view.key), self.config
        worker.load, worker.queued_units = worker.load + 1, worker.queued_units + size
        worker.counts["requests"] += 1
        worker.breaker.dispatched()
        self.policy.on_dispatch(worker.id, view, time.monotonic())
        self._maybe_evict()
        streamed = False
        headers = self._forward_headers(req)
        if trace is not None:  # the worker's spans join this attempt's
            headers += trace.dispatched(worker, self.policy, number)

        def on_head(status: int, headers: Headers, chunked: bool) -> Callable[[bytes], None] | None:
            nonlocal streamed
            if not chunked or status >= 500:
                return None  # buffered: a 5xx may be retried, and is not a stream anyway
            streamed = True
            conn.begin_stream(status, passback(headers, req.rid), req.http11)
            return conn.chunk

        try:
            resp = await worker.pool.request(
                "POST", req.path, req.body, on_head, cfg.request_timeout_secs,
                headers, cfg.stream_timeout_secs, conn.bind,
            )  # fmt: skip
        except UpstreamError as exc:
            why = Failure(str(exc), 504 if exc.timed_out else 502, exc.retryable, exc.lost)
            if trace is not None:
                trace.settled(None, str(exc))
            return self._failed(conn, req, worker, why, streamed)
        finally:
            worker.load, worker.queued_units = worker.load - 1, worker.queued_units - size
            worker.breaker.settled()
            self.policy.on_complete(worker.id, view, time.monotonic())
        if trace is not None:
            trace.settled(resp.status)
        if resp.status in RETRYABLE:
            why = Failure(f"status {resp.status}", 502, True, False)
            return self._failed(conn, req, worker, why, streamed)
        worker.breaker.record(resp.status < 500, time.monotonic())
        worker.counts["errors"] += resp.status >= 500
        log.debug("request %s %s -> %s: %d", req.rid, req.path, worker.url, resp.status)
        if streamed:
            conn.end_stream(req.keep_alive)
        else:
            headers = passback(resp.headers, req.rid)
            conn.send(resp.status, None, resp.body, req.keep_alive, headers)
        return None

    def _failed(
        self, conn: ClientConn, req: Request, worker: Worker, why: Failure, streamed: bool
    ) -> Failure | None:
        worker.counts["errors"] += 1
        worker.breaker.record(False, time.monotonic())
        if not streamed:
            return why
        # Bytes already reached the client: end the stream as OpenAI-compatible servers do.
        log.warning("request %s: stream from %s cut: %s", req.rid, worker.url, why.why)
        conn.abort_stream(502, f"worker failed mid-stream: {why.why}", req.keep_alive, req.path)
        return None


class Failure(NamedTuple):
    """Why an attempt failed: what to answer if it is the last, and whether to try again."""

    why: str
    status: int
    retry: bool
    lost: bool
