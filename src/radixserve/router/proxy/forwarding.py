"""The router's forwarding of one inference request: its routing view (the body parsed, with
kv_aware the prompt tokenized off the loop), the policy's pick, the attempt on that worker with
its stream relayed as it arrives, retries elsewhere with backoff, and the answer when all fail."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from bisect import bisect_left
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from radixserve.router.policies.base import NoWorkerAvailable, RequestView, RouterPolicy
from radixserve.router.policies.tree_keys import units
from radixserve.router.proxy.admission import Admission
from radixserve.router.proxy.config import RouterConfig
from radixserve.router.proxy.connections import ClientConn, Request, passback
from radixserve.router.proxy.errors import error_for
from radixserve.router.proxy.kv_setup import KvRouting
from radixserve.router.proxy.metrics import BUCKETS
from radixserve.router.proxy.request_body import request_view, routed_payload
from radixserve.router.proxy.route_trace import RouteTrace
from radixserve.router.proxy.workers import Headers, UpstreamError, Worker, WorkerRegistry

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


class Forwarding:
    """Router's inference path (mixed into it; proxy/app.py owns the state below and
    ``_maybe_evict``)."""

    config: RouterConfig
    registry: WorkerRegistry
    policy: RouterPolicy
    admission: Admission
    pd: Any  # proxy/pd.py's PdDispatch, or None
    kv: KvRouting | None
    kvs: Any  # kv_setup.open_kv_index's shared index reader, or None
    tracer: Any  # radixserve.tracing.Tracer, or None
    retries: int
    failed: dict[int, int]
    decisions: list[int]
    decision_sum: float
    _tokenizing: ThreadPoolExecutor | None
    _timeout_said: float

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
