"""The router's HTTP face: an asyncio + httptools server that proxies inference to workers
(streams passed through as they arrive), retries failures elsewhere, and serves admin and metrics.

Why not a framework: on a 2-core VM, aiohttp's server and client together cost more CPU per
request than the 4 workers behind the router; see benchmarks/router_bench.py for the numbers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from urllib.parse import parse_qs, unquote

import httptools

from radixserve.router.config import RouterConfig
from radixserve.router.keys import units
from radixserve.router.kv_routing import KvRouting, fetch_json
from radixserve.router.policies import NoWorkerAvailable, RequestView, create_policy
from radixserve.router.workers import (
    Headers,
    Response,
    UpstreamError,
    Worker,
    WorkerRegistry,
    fan_out,
)

try:  # 5x faster on long prompts; the stdlib parser is the fallback
    from orjson import loads
except ImportError:  # pragma: no cover
    from json import loads

log = logging.getLogger("radixserve.router")

INFERENCE = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
OPEN = frozenset({"/health", "/readiness", "/liveness", "/get_loads", "/metrics"})
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
PREFIX = "radixserve_router_"
BUCKETS = (2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


def error_body(status: int, message: str, kind: str = "") -> dict[str, object]:
    """OpenAI-style error object."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "code": status}}


class Request:
    __slots__ = ("method", "path", "query", "auth", "body", "keep_alive")

    def __init__(self, method: str, url: str, auth: bytes, body: bytes, keep_alive: bool) -> None:
        self.method, self.auth, self.body, self.keep_alive = method, auth, body, keep_alive
        self.path, _, self.query = url.partition("?")


class ClientConn(asyncio.Protocol):
    """One client connection; requests on it are answered in order, one at a time."""

    def __init__(self, router: Router) -> None:
        self.router, self.max_body = router, router.config.max_payload_size
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.pending: deque[Request] = deque()
        self.refused = False
        self._reset()

    def _reset(self) -> None:
        self.url, self.auth, self.body, self.size = b"", b"", [], 0
        self.expect = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()  # aborts the upstream request too: the worker stops generating

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # the rest of a refused request, read and dropped so that the answer arrives
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.size > self.max_body:
                self.refuse(413, f"request body too large (limit {self.max_body} bytes)")
            else:
                self.refuse(400, "malformed HTTP request")

    def refuse(self, status: int, message: str) -> None:
        """Answer and half-close: closing outright with unread input would reset the connection
        and the client might never read the answer."""
        self.refused = True
        self.send_json(status, error_body(status, message))
        if self.transport is not None and self.transport.can_write_eof():
            self.transport.write_eof()
            asyncio.get_running_loop().call_later(5.0, self.transport.close)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"authorization":
            self.auth = value
        elif name == b"expect":
            self.expect = value.lower() == b"100-continue"
        elif name == b"content-length" and value.isdigit() and int(value) > self.max_body:
            self.size = int(value)
            raise ValueError("payload too large")  # refused before the body is read

    def on_headers_complete(self) -> None:
        if self.expect:  # curl waits a second for this before it sends a body over 1 KiB
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.max_body:  # chunked bodies have no length up front
            raise ValueError("payload too large")
        self.body.append(body)

    def on_message_complete(self) -> None:
        p = self.parser
        req = Request(
            p.get_method().decode(),
            self.url.decode(),
            self.auth,
            b"".join(self.body),
            p.should_keep_alive(),
        )
        self._reset()
        if self.task is None:
            self.start(req)
        else:
            self.pending.append(req)

    def start(self, req: Request) -> None:
        self.task = asyncio.get_running_loop().create_task(self.router.handle(self, req))
        self.task.add_done_callback(self._done)

    def _done(self, _task: asyncio.Task[None]) -> None:
        self.task = None
        if self.pending and self.transport is not None:
            self.start(self.pending.popleft())

    def send(self, status: int, ctype: bytes, body: bytes, keep_alive: bool = True) -> None:
        reason = REASONS.get(status, b"")
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
            (status, reason, ctype, len(body))
        )
        self.write(head + (b"\r\n" if keep_alive else b"Connection: close\r\n\r\n") + body)
        if not keep_alive and self.transport is not None:
            self.transport.close()

    def send_json(self, status: int, obj: object, keep_alive: bool = True) -> None:
        self.send(status, b"application/json", json.dumps(obj).encode(), keep_alive)

    def begin_stream(self, status: int, ctype: bytes) -> None:
        self.write(
            b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n"
            b"Cache-Control: no-cache\r\n\r\n" % (status, ctype)
        )

    def end_stream(self, keep_alive: bool) -> None:
        self.write(b"0\r\n\r\n")
        if not keep_alive and self.transport is not None:
            self.transport.close()

    def chunk(self, data: bytes) -> None:
        if data:
            self.write(b"%x\r\n%b\r\n" % (len(data), data))

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)


class Router:
    """The router: its registry, policy, metrics and HTTP endpoints."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy = create_policy(config.policy, config.policy_config())
        self.registry = WorkerRegistry(config.health_config(), self.policy.on_worker_removed)
        # kv_aware: an index fed by the workers' KV events, prompts tokenized as they do
        has_index = getattr(self.policy, "index", None) is not None
        self.kv = KvRouting(self.policy, config.tokenizer) if has_index else None
        self.registry.poll_loads = has_index  # kv_aware reconciles pending prefill with them
        self.retries, self.failed = 0, {502: 0, 503: 0}
        self.decisions = [0] * (len(BUCKETS) + 1)
        self.decision_sum = 0.0
        self.server: asyncio.AbstractServer | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.routes: dict[tuple[str, str], Callable[[Request], Awaitable[tuple[int, object]]]] = {}
        self._add_routes()

    def _add_routes(self) -> None:
        r = self.routes
        r["GET", "/health"] = r["GET", "/readiness"] = self.readiness
        r["GET", "/liveness"] = self.liveness
        r["GET", "/get_loads"] = self.get_loads
        r["GET", "/metrics"] = self.metrics
        r["GET", "/v1/models"] = self.models
        r["POST", "/flush_cache"] = self.flush_cache
        r["GET", "/workers"] = r["GET", "/list_workers"] = self.list_workers
        r["POST", "/workers"] = self.add_worker
        r["POST", "/add_worker"] = self.add_worker
        r["POST", "/remove_worker"] = r["DELETE", "/workers/"] = self.remove_worker

    async def start(self) -> int:
        """Listen and start background work; returns the bound port. Unreachable workers do not
        delay this: health checks and the circuit breaker find them out."""
        for url in self.config.worker_urls:
            self._watch(self.registry.add(url))
        self.registry.start()
        if self.config.eviction_interval_secs > 0:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        self.server = await asyncio.get_running_loop().create_server(
            lambda: ClientConn(self), self.config.host, self.config.port, backlog=4096
        )
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._ticker is not None:
            self._ticker.cancel()
        if self.kv is not None:
            await self.kv.stop()
        await self.registry.stop()

    def _watch(self, worker: Worker) -> None:
        """kv_aware: check the worker's tokenizer, then subscribe to its KV events."""
        if self.kv is None:
            return
        kv = self.kv

        async def admit() -> None:
            if not await kv.admit(
                worker.id, worker.url, lambda p: fetch_json(worker.pool.request, p)
            ):
                self.registry.remove(worker)

        asyncio.get_running_loop().create_task(admit())

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.eviction_interval_secs)
            self.policy.tick(time.monotonic())

    # ----- dispatch -----

    async def handle(self, conn: ClientConn, req: Request) -> None:
        """Answer one request; never raises (a handler bug becomes a 500 with an error body)."""
        try:
            if req.path in INFERENCE and req.method == "POST":
                if self._authorized(req, self.config.api_key, conn):
                    await self.proxy(conn, req)
                return
            route = req.path if not req.path.startswith("/workers/") else "/workers/"
            handler = self.routes.get((req.method, route))
            if handler is None:
                conn.send_json(404, error_body(404, f"no route for {req.method} {req.path}"))
            elif self._authorized(req, self._key_for(route), conn):
                status, obj = await handler(req)
                if isinstance(obj, Text):
                    conn.send(status, b"text/plain; version=0.0.4", obj.encode(), req.keep_alive)
                else:
                    conn.send_json(status, obj, req.keep_alive)
        except Exception:
            log.exception("error while answering %s %s", req.method, req.path)
            conn.send_json(500, error_body(500, "internal router error"), keep_alive=False)

    def _key_for(self, route: str) -> str | None:
        """Probes and metrics are open; /v1/models is for inference clients; the rest is admin."""
        if route in OPEN:
            return None
        if route == "/v1/models":
            return self.config.api_key
        return self.config.admin_api_key or self.config.api_key

    @staticmethod
    def _authorized(req: Request, key: str | None, conn: ClientConn) -> bool:
        if key is None or hmac.compare_digest(req.auth, b"Bearer " + key.encode()):
            return True
        conn.send_json(401, error_body(401, "missing or wrong API key", "authentication_error"))
        return False

    # ----- proxying -----

    async def proxy(self, conn: ClientConn, req: Request) -> None:
        """Route, forward and relay one inference request, retrying elsewhere while nothing
        has reached the client yet."""
        try:
            payload = loads(req.body)
            view = RequestView.from_payload(payload)
        except (ValueError, TypeError, AttributeError) as exc:
            conn.send_json(400, error_body(400, f"request body is not a JSON object: {exc}"))
            return
        if self.kv is not None:
            view = self.kv.view(payload, view)
        tried: list[str] = []
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self.retries += 1
                await asyncio.sleep(self._backoff(attempt))
            worker = self.pick(view, tried)
            if worker is None:
                break
            failure = await self.attempt(conn, req, worker, view)
            if failure is None:
                return
            tried.append(worker.id)
            log.warning("attempt %d on %s failed: %s", attempt + 1, worker.url, failure)
        self.fail(conn, tried)

    def _backoff(self, attempt: int) -> float:
        cfg = self.config
        return min(cfg.retry_backoff_ms * 2 ** (attempt - 1), cfg.retry_max_backoff_ms) / 1000

    def fail(self, conn: ClientConn, tried: list[str]) -> None:
        if tried:
            status, msg = 502, f"request failed on {len(tried)} attempt(s) ({', '.join(tried)})"
        else:
            status, msg = 503, "no healthy worker available"
        self.failed[status] += 1
        conn.send_json(status, error_body(status, msg, "service_unavailable"))

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

    async def attempt(
        self, conn: ClientConn, req: Request, worker: Worker, view: RequestView
    ) -> str | None:
        """One try on `worker`: None when the client got its answer, else why it failed."""
        size = units(view.key)
        worker.load, worker.queued_units = worker.load + 1, worker.queued_units + size
        worker.counts["requests"] += 1
        self.policy.on_dispatch(worker.id, view, time.monotonic())
        streamed = False

        def on_head(status: int, headers: Headers, chunked: bool) -> Callable[[bytes], None] | None:
            nonlocal streamed
            if not chunked or status >= 500:
                return None  # buffered: a 5xx can still be retried
            streamed = True
            conn.begin_stream(status, _ctype(headers))
            return conn.chunk

        try:
            resp = await worker.pool.request(
                "POST", req.path, req.body, on_head, self.config.request_timeout_secs
            )
        except UpstreamError as exc:
            return self._failed(conn, worker, str(exc), streamed)
        finally:
            worker.load, worker.queued_units = worker.load - 1, worker.queued_units - size
            self.policy.on_complete(worker.id, view, time.monotonic())
        if resp.status >= 500:
            return self._failed(conn, worker, f"status {resp.status}", streamed)
        worker.breaker.record(True, time.monotonic())
        if streamed:
            conn.end_stream(req.keep_alive)
        else:
            conn.send(resp.status, _ctype(resp.headers), resp.body, req.keep_alive)
        return None

    def _failed(self, conn: ClientConn, worker: Worker, why: str, streamed: bool) -> str | None:
        worker.counts["errors"] += 1
        worker.breaker.record(False, time.monotonic())
        if not streamed:
            return why
        # Bytes already reached the client: tell it in-band, and end the connection so that
        # no client can take the truncated stream for a complete one.
        event = json.dumps(error_body(502, f"worker failed mid-stream: {why}"))
        conn.chunk(b"data: " + event.encode() + b"\n\n")
        if conn.transport is not None:
            conn.transport.close()
        return None

    # ----- endpoints -----

    async def liveness(self, req: Request) -> tuple[int, object]:
        return 200, {"status": "ok"}

    async def readiness(self, req: Request) -> tuple[int, object]:
        ready = self.registry.routable()
        return (200 if ready else 503), {
            "status": "ok" if ready else "no healthy worker",
            "healthy_workers": ready,
        }

    async def get_loads(self, req: Request) -> tuple[int, object]:
        now, pending = time.monotonic(), getattr(self.policy, "pending", None)
        rows = []
        for w in self.registry.workers:
            row = {"id": w.id, "url": w.url, "load": w.load, "healthy": w.healthy}
            if pending is not None:  # kv_aware: prefill the worker reported, and the total
                row["reported_prefill_tokens"] = w.prefill_tokens
                row["pending_prefill_tokens"] = pending(w.view(now))
            rows.append(row)
        return 200, {"workers": rows}

    async def list_workers(self, req: Request) -> tuple[int, object]:
        workers = self.registry.workers
        return 200, {"workers": [w.info() for w in workers], "urls": [w.url for w in workers]}

    async def add_worker(self, req: Request) -> tuple[int, object]:
        url = _query(req, "url") or (_json(req).get("url") if req.body else None)
        if not isinstance(url, str) or not url:
            return 400, error_body(400, 'give the worker as ?url= or a JSON body {"url": ...}')
        try:
            worker = self.registry.add(url)
        except ValueError as exc:
            status = 409 if "already" in str(exc) else 400
            return status, error_body(status, str(exc))
        self._watch(worker)
        return 201 if req.path == "/workers" else 200, worker.info()

    async def remove_worker(self, req: Request) -> tuple[int, object]:
        ref = (
            unquote(req.path[len("/workers/") :]) if req.method == "DELETE" else _query(req, "url")
        )
        worker = self.registry.get(ref) if ref else None
        if worker is None:
            return 404, error_body(404, f"no worker {ref!r}")
        self.registry.remove(worker)
        if self.kv is not None:
            await self.kv.forget(worker.id)
        return 200, {"removed": worker.id, "url": worker.url}

    async def models(self, req: Request) -> tuple[int, object]:
        routable = [w for w in self.registry.workers if w.view(time.monotonic()).healthy]
        for reply in await fan_out(routable, "GET", "/v1/models"):
            if isinstance(reply, Response) and reply.status == 200:
                return 200, loads(reply.body)
        return 503, error_body(503, "no healthy worker answered /v1/models")

    async def flush_cache(self, req: Request) -> tuple[int, object]:
        workers = self.registry.workers
        replies = await fan_out(workers, "POST", "/flush_cache")
        results = {w.url: getattr(r, "status", str(r)) for w, r in zip(workers, replies)}
        for worker in workers:  # their caches are empty now: so must the router's belief be
            self.policy.on_worker_removed(worker.id)
        ok = all(s == 200 for s in results.values())
        return (200 if ok else 502), {"success": ok, "workers": results}

    async def metrics(self, req: Request) -> tuple[int, object]:
        return 200, Text("\n".join(self._metric_lines()) + "\n")

    def _metric_lines(self) -> list[str]:
        ws, now = self.registry.workers, time.monotonic()
        sizes = getattr(self.policy, "tree_size", dict)()
        hit_rate = getattr(self.policy, "expected_hit_rate", lambda: 0.0)()
        families = [
            ("requests_total", "counter", {w.url: w.counts["requests"] for w in ws}),
            ("errors_total", "counter", {w.url: w.counts["errors"] for w in ws}),
            ("worker_load", "gauge", {w.url: w.load for w in ws}),
            ("worker_healthy", "gauge", {w.url: int(w.view(now).healthy) for w in ws}),
            ("tree_size_units", "gauge", {w.url: sizes.get(w.id, 0) for w in ws}),
            ("retries_total", "counter", {"": self.retries}),
            ("expected_hit_rate", "gauge", {"": round(hit_rate, 6)}),
        ]
        if self.kv is not None:
            urls = {w.id: w.url for w in ws}
            families += [
                (n, k, {urls.get(w, str(w)) if w != "" else "": v for w, v in samples.items()})
                for n, k, samples in self.kv.metric_families()
            ]
        lines = [line for family in families for line in _family(*family)]
        failed = {str(code): n for code, n in self.failed.items()}
        lines += _family("failed_requests_total", "counter", failed, label="code")
        return lines + _histogram(f"{PREFIX}decision_seconds", self.decisions, self.decision_sum)


class Text(str):
    """A handler's plain-text answer (Prometheus exposition format)."""


def _family(name: str, kind: str, samples: dict[str, object], label: str = "worker") -> list[str]:
    name = PREFIX + name
    lines = [f"# TYPE {name} {kind}"]
    for key, value in samples.items():
        lines.append(f'{name}{{{label}="{key}"}} {value}' if key else f"{name} {value}")
    return lines


def _histogram(name: str, counts: list[int], total: float) -> list[str]:
    lines, running = [f"# TYPE {name} histogram"], 0
    for bound, n in zip([*map(str, BUCKETS), "+Inf"], counts):
        running += n
        lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
    return [*lines, f"{name}_sum {total:.9f}", f"{name}_count {running}"]


def _ctype(headers: Headers) -> bytes:
    return next((v for n, v in headers if n == b"content-type"), b"application/json")


def _query(req: Request, name: str) -> str | None:
    values = parse_qs(req.query).get(name)
    return values[0] if values else None


def _json(req: Request) -> dict:
    try:
        obj = loads(req.body)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}
