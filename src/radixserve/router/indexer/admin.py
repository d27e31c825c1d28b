"""The kv-indexer's HTTP face: health, Prometheus metrics, and the router's worker-admin
endpoints (same paths, bodies and answers as `radixserve route`). Served by the router's own
HTTP/1.1 connection code (proxy/connections.py) and prometheus-client, as the router's admin API
is: one web stack for both programs."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from radixserve.router.indexer.metrics import metrics_registry
from radixserve.router.indexer.service import Indexer
from radixserve.router.proxy.connections import ClientConn, Request
from radixserve.router.proxy.errors import error_body

log = logging.getLogger("radixserve.kv_indexer")
ADMIN_ROUTES = {"/workers": ("GET", "POST"), "/list_workers": ("GET",),
                "/add_worker": ("POST",), "/remove_worker": ("POST",), "/workers/": ("DELETE",)}  # fmt: skip
OPEN_ROUTES = {"/health": ("GET",), "/liveness": ("GET",), "/metrics": ("GET",)}


@dataclass(frozen=True, slots=True)
class AdminLimits:
    """What the admin API's connections accept (the router's limits, scaled to an admin API)."""

    max_payload_size: int = 1 << 20
    max_url_size: int = 8192
    max_header_size: int = 16384
    max_connections: int = 256
    header_timeout_secs: float = 30.0
    body_timeout_secs: float = 30.0
    keep_alive_timeout_secs: float = 75.0
    session_header: str = "X-Session-Id"


class AdminServer:
    """Health, metrics and worker management, in the router's shapes."""

    def __init__(self, indexer: Indexer, admin_api_key: str | None) -> None:
        self.indexer, self.admin_api_key = indexer, admin_api_key
        self.config = AdminLimits()
        self.connections = 0
        self.metrics_registry = metrics_registry(indexer)
        self.server: asyncio.AbstractServer | None = None

    async def start(self, sock: socket.socket) -> None:
        """Serve on `sock` (bound, not yet listening)."""
        self.server = await asyncio.get_running_loop().create_server(
            lambda: ClientConn(self), sock=sock, backlog=128
        )

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def handle(self, conn: ClientConn, req: Request) -> None:
        """Answer one request; never raises (a bug becomes a 500 with an error body)."""
        try:
            status, obj = await self._answer(req)
        except Exception:
            log.exception("error while answering %s %s", req.method, req.path)
            status, obj = 500, error_body(500, "internal kv-indexer error")
        if isinstance(obj, bytes):
            conn.send(status, CONTENT_TYPE_LATEST.encode(), obj, req.keep_alive)
        else:
            conn.send_json(status, obj, req.keep_alive)

    async def _answer(self, req: Request) -> tuple[int, object]:
        route = "/workers/" if req.path.startswith("/workers/") else req.path
        methods = OPEN_ROUTES.get(route) or ADMIN_ROUTES.get(route)
        method = "GET" if req.method == "HEAD" else req.method
        if methods is None:
            return 404, error_body(404, f"no route for {req.method} {req.path}")
        if method not in methods:
            allowed = ", ".join(methods)
            return 405, error_body(405, f"method {req.method} not allowed on {req.path} "
                                        f"(allowed: {allowed})")  # fmt: skip
        if route in ADMIN_ROUTES and not self._authorized(req):
            return 401, error_body(401, "missing or wrong API key", "authentication_error")
        indexer = self.indexer
        if route in ("/health", "/liveness"):
            return 200, {"status": "ok", "redis": indexer.writer.redis_ok,
                         "workers": len(indexer.followed)}  # fmt: skip
        if route == "/metrics":
            return 200, generate_latest(self.metrics_registry)
        if method == "GET":
            workers = list(indexer.followed.values())
            return 200, {"workers": [w.info() for w in workers], "urls": [w.url for w in workers]}
        if route in ("/workers", "/add_worker"):
            return await self._add(req, route)
        url = unquote(req.path[len("/workers/") :]) if route == "/workers/" else _query(req)
        worker = await indexer.remove(url) if url else None
        if worker is None:
            return 404, error_body(404, f"no worker {url!r}")
        return 200, {"removed": worker.url, "url": worker.url}

    async def _add(self, req: Request, route: str) -> tuple[int, object]:
        url, problem = _url_of(req)
        if problem:
            return 400, error_body(400, problem)
        try:
            worker = self.indexer.add(url)
        except ValueError as exc:
            status = 409 if "already" in str(exc) else 400
            return status, error_body(status, str(exc))
        return (201 if route == "/workers" else 200), worker.info()

    def _authorized(self, req: Request) -> bool:
        key = self.admin_api_key
        return key is None or hmac.compare_digest(req.auth, b"Bearer " + key.encode())


def _query(req: Request) -> str:
    values = parse_qs(req.query).get("url")
    return values[0] if values else ""


def _url_of(req: Request) -> tuple[str, str]:
    """The worker URL of an add request (?url= or {"url": ...}), or why there is none."""
    url: object = _query(req) or None
    if url is None and req.body:
        try:
            obj = json.loads(req.body)
        except ValueError:
            return "", "request body is not JSON"
        if not isinstance(obj, dict):
            return "", 'give the worker as ?url= or a JSON body {"url": ...}'
        unknown = sorted(set(obj) - {"url"})
        if unknown:
            return "", f"unknown field(s) {', '.join(unknown)}: only url is accepted"
        url = obj.get("url")
    if not isinstance(url, str) or not url:
        return "", 'give the worker as ?url= or a JSON body {"url": ...}'
    return url, ""
