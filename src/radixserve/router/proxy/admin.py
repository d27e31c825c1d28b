"""The router's own endpoints besides proxying: probes, loads, worker management, model list,
cache flush and metrics. A mixin of Router (app.py), which owns the registry and policy; what
the handlers read of it is the AdminHost protocol below (no import of app.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol
from urllib.parse import parse_qs, unquote

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from radixserve.router.proxy.config import DEFAULT_BOOTSTRAP_PORT
from radixserve.router.proxy.connections import ClientConn, Request
from radixserve.router.proxy.errors import error_body, error_for
from radixserve.router.proxy.worker_kinds import http_get
from radixserve.router.proxy.worker_shapes import (
    FLUSH,
    KINDS,
    flush_failure,
    parse_kv_events,
)
from radixserve.router.proxy.workers import DuplicateWorker, Response, fan_out, resolve

try:  # 5x faster on long prompts; the stdlib parser is the fallback
    from orjson import loads
except ImportError:  # pragma: no cover
    from json import loads

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from radixserve.router.policies.base import RouterPolicy
    from radixserve.router.proxy.config import RouterConfig
    from radixserve.router.proxy.kv_setup import KvRouting
    from radixserve.router.proxy.worker_kinds import WorkerKinds
    from radixserve.router.proxy.workers import Worker, WorkerRegistry


class AdminHost(Protocol):
    """What the admin handlers use of the router they are mixed into."""

    config: RouterConfig
    registry: WorkerRegistry
    policy: RouterPolicy
    kv: KvRouting | None
    kinds: WorkerKinds
    metrics_registry: CollectorRegistry
    routes: dict[str, dict[str, Handler]]

    async def admit(self, worker: Worker) -> bool: ...
    def _forward_headers(self, req: Request) -> bytes: ...
    def _worker_auth(self) -> bytes: ...
    def _allowed(self, req: Request, route: str, conn: ClientConn) -> bool: ...
    @staticmethod
    def _authorized(req: Request, key: str | None, conn: ClientConn) -> bool: ...


INFERENCE = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/messages",
                       "/v1/messages/count_tokens"})  # fmt: skip
OPEN = frozenset({"/health", "/readiness", "/liveness", "/get_loads", "/metrics"})
Handler = Callable[[Request], Awaitable[tuple[int, object]]]


def not_allowed(conn: ClientConn, req: Request, allow: str) -> None:
    """A 405 naming the methods `req.path` takes."""
    msg = f"method {req.method} not allowed on {req.path} (allowed: {allow})"
    conn.send_json(405, error_for(req.path, 405, msg), headers=b"Allow: %s\r\n" % allow.encode())


class Text(str):
    """A handler's plain-text answer (Prometheus exposition format)."""


class Endpoints:
    """Handlers: each takes the request and returns (status, JSON-able object or Text)."""

    def add_routes(self: AdminHost) -> None:
        """The admin API's routes, into `self.routes`."""

        def route(method: str, handler: Handler, *paths: str) -> None:
            for path in paths:
                self.routes.setdefault(path, {})[method] = handler

        route("GET", self.readiness, "/health", "/readiness")
        route("GET", self.liveness, "/liveness")
        route("GET", self.get_loads, "/get_loads")
        route("GET", self.metrics, "/metrics")
        route("GET", self.models, "/v1/models")
        route("POST", self.flush_cache, "/flush_cache")
        route("GET", self.list_workers, "/workers", "/list_workers")
        route("POST", self.add_worker, "/workers", "/add_worker")
        route("POST", self.remove_worker, "/remove_worker")
        route("DELETE", self.remove_worker, "/workers/")

    async def answer_admin(self: AdminHost, conn: ClientConn, req: Request) -> None:
        """Answer a request that is not inference: route, method, access, then the handler."""
        if req.path in INFERENCE:
            not_allowed(conn, req, "POST")
            return
        route = req.path if not req.path.startswith("/workers/") else "/workers/"
        methods = self.routes.get(route)
        if methods is None:
            msg = f"no route for {req.method} {req.path}"
            conn.send_json(404, error_for(req.path, 404, msg))
            return
        handler = methods.get("GET" if req.method == "HEAD" else req.method)
        if handler is None:
            not_allowed(conn, req, ", ".join(sorted(methods)))
        elif self._allowed(req, route, conn):
            status, obj = await handler(req)
            if isinstance(obj, Text):
                conn.send(status, CONTENT_TYPE_LATEST.encode(), obj.encode(), req.keep_alive)
            else:
                conn.send_json(status, obj, req.keep_alive)

    def _allowed(self: AdminHost, req: Request, route: str, conn: ClientConn) -> bool:
        """Probes and metrics are open; /v1/models is for inference clients; the rest is admin:
        the admin key when there is one, else loopback clients only (an API key never grants
        it: an API user must not send prompts to a host of their choosing, or remove workers)."""
        if route in OPEN:
            return True
        if route == "/v1/models":
            return self._authorized(req, self.config.api_key, conn)
        if self.config.admin_api_key is not None:
            return self._authorized(req, self.config.admin_api_key, conn)
        if conn.local:
            return True
        msg = "worker management is open to loopback clients only (set --admin-api-key)"
        conn.send_json(403, error_body(403, msg, "permission_error"))
        return False

    async def liveness(self: AdminHost, req: Request) -> tuple[int, object]:
        return 200, {"status": "ok"}

    async def readiness(self: AdminHost, req: Request) -> tuple[int, object]:
        ready = self.registry.routable()
        return (200 if ready else 503), {
            "status": "ok" if ready else "no healthy worker",
            "healthy_workers": ready,
        }

    async def get_loads(self: AdminHost, req: Request) -> tuple[int, object]:
        now, rows = time.monotonic(), []
        for w in self.registry.workers:
            row = {"id": w.id, "url": w.url, "load": w.load, "healthy": w.healthy}
            pending = self.policy.pending(w.view(now))
            if pending is not None:  # kv_aware: prefill the worker reported, and the total
                row["reported_prefill_tokens"] = w.prefill_tokens
                row["pending_prefill_tokens"] = pending
                # what its tier-aware score charges a loaded token (None: the default)
                row["kv_load_to_prefill_ratio"] = w.kv_load_ratio
                row["kv_store_load_to_prefill_ratio"] = w.kv_store_load_ratio
            rows.append(row)
        return 200, {"workers": rows}

    async def list_workers(self: AdminHost, req: Request) -> tuple[int, object]:
        workers = self.registry.workers
        rows = [{**w.info(), **self.kinds.info(w.id)} for w in workers]
        return 200, {"workers": rows, "urls": [w.url for w in workers]}

    async def add_worker(self: AdminHost, req: Request) -> tuple[int, object]:
        """Register a worker; it takes traffic once its first health probe passes (and, with
        kv_aware, once its tokenizer is checked and its KV events subscribed to). Optional
        ``type`` (radixserve, vllm, sglang; default: --worker-type) and ``kv_events``
        (``{"endpoint", "replay_endpoint", "topic"}``: where it publishes, if not where it says);
        with --pd-disaggregation ``role`` (prefill or decode) and, for a prefill worker,
        ``bootstrap_port`` (default 8998)."""
        body = _json(req) if req.body else {}
        unknown = sorted(set(body) - {"url", "type", "kv_events", "role", "bootstrap_port"})
        if unknown:  # nothing a client sets is silently ignored
            return 400, error_body(400, f"unknown field(s) {', '.join(unknown)}: accepted are "
                                   "url, type, kv_events, role, bootstrap_port")  # fmt: skip
        try:
            role, port = worker_role(body, self.config.pd_disaggregation)
        except ValueError as exc:
            return 400, error_body(400, str(exc))
        url = _query(req, "url") or body.get("url")
        if not isinstance(url, str) or not url:
            return 400, error_body(400, 'give the worker as ?url= or a JSON body {"url": ...}')
        kind = body.get("type")
        if kind is not None and kind not in KINDS:
            return 400, error_body(400, f"type must be one of {', '.join(KINDS)}, not {kind!r}")
        try:
            override = parse_kv_events(body["kv_events"]) if "kv_events" in body else None
            worker = self.registry.add(url, await resolve(url), False, role, port)
        except ValueError as exc:
            status = 409 if isinstance(exc, DuplicateWorker) else 400
            return status, error_body(status, str(exc))
        self.kinds.register(worker.id, worker.url, kind, override)
        if not await self.admit(worker):  # kv_aware: checked before it can take traffic
            why = self.kv.refused.get(worker.url, "refused") if self.kv else "refused"
            return 409, error_body(409, f"worker {url} refused: {why}")
        await self.registry.probe_now(worker)
        return 201 if req.path == "/workers" else 200, {
            **worker.info(),
            **self.kinds.info(worker.id),
        }

    async def remove_worker(self: AdminHost, req: Request) -> tuple[int, object]:
        ref = (
            unquote(req.path[len("/workers/") :]) if req.method == "DELETE" else _query(req, "url")
        )
        worker = self.registry.get(ref) if ref else None
        if worker is None:
            return 404, error_body(404, f"no worker {ref!r}")
        self.registry.remove(worker)
        self.kinds.forget(worker.id)
        if self.kv is not None:
            await self.kv.forget(worker.id)
        return 200, {"removed": worker.id, "url": worker.url}

    async def models(self: AdminHost, req: Request) -> tuple[int, object]:
        routable = [w for w in self.registry.workers if w.view(time.monotonic()).healthy]
        headers = self._forward_headers(req)
        for reply in await fan_out(routable, "GET", "/v1/models", headers):
            if isinstance(reply, Response) and reply.status == 200:
                return 200, loads(reply.body)
        return 503, error_body(503, "no healthy worker answered /v1/models")

    async def flush_cache(self: AdminHost, req: Request) -> tuple[int, object]:
        """Flush every worker's prefix cache, each the way its kind does (vLLM:
        /reset_prefix_cache), and forget what the router believed they held."""
        workers, headers = self.registry.workers, self._forward_headers(req)
        auth = self._worker_auth()
        await asyncio.gather(*(self.kinds.identify(w.id, w.url, http_get(w.pool.request, auth))
                               for w in workers))  # fmt: skip
        calls = []
        for w in workers:
            method, path = FLUSH.get(self.kinds.state(w.id).kind or "", FLUSH["radixserve"])
            calls.append(w.pool.request(method, path, timeout=30.0, headers=headers))
        replies = await asyncio.gather(*calls, return_exceptions=True)
        results = {w.url: getattr(r, "status", str(r)) for w, r in zip(workers, replies)}
        for worker in workers:  # their caches are empty now: so must the router's belief be
            self.policy.on_worker_removed(worker.id)
        ok = all(s == 200 for s in results.values())
        body: dict[str, object] = {"success": ok, "workers": results}
        failed = {w.url: flush_failure(self.kinds.state(w.id).kind, s)
                  for w, s in zip(workers, results.values()) if isinstance(s, int) and s != 200}  # fmt: skip
        if failed:
            body["errors"] = failed
        return (200 if ok else 502), body

    async def metrics(self: AdminHost, req: Request) -> tuple[int, object]:
        return 200, Text(generate_latest(self.metrics_registry).decode())


def _query(req: Request, name: str) -> str | None:
    values = parse_qs(req.query).get(name)
    return values[0] if values else None


def _json(req: Request) -> dict:
    try:
        obj = loads(req.body)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def worker_role(body: dict, pd: bool) -> tuple[str, int | None]:
    """(role, bootstrap port) of a worker being added; ValueError saying what is wrong."""
    role, port = body.get("role"), body.get("bootstrap_port")
    if not pd:
        if role not in (None, "neutral") or port is not None:
            raise ValueError("role and bootstrap_port are for a router started with "
                             "--pd-disaggregation (its workers are all neutral)")  # fmt: skip
        return "neutral", None
    if role not in ("prefill", "decode"):
        raise ValueError(f'a PD router\'s workers need "role": "prefill" or "decode", not {role!r}')
    if port is not None and (role != "prefill" or type(port) is not int or not 0 < port < 65536):
        raise ValueError("bootstrap_port: a prefill worker's port, 1-65535")
    return role, (port or DEFAULT_BOOTSTRAP_PORT) if role == "prefill" else None
