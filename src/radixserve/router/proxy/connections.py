"""The router's HTTP/1.1 connections (asyncio + httptools): parsing client connections within
limits and timeouts, and answering pipelined requests in order. The request as read lives in
http_request.py, the writing of plain, JSON and streamed responses in responses.py (mixed into
ClientConn); proxy logic lives in app.py; nothing here knows about workers or policies: a
connection hands each request to its Server's `handle` (the router's proxy, or the kv-indexer's
admin API)."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import TYPE_CHECKING, Protocol

import httptools

from radixserve.router.proxy.errors import error_for
from radixserve.router.proxy.http_request import Refusal, Request, request_id
from radixserve.router.proxy.responses import REASONS, Responses, passback  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from radixserve.router.proxy.upstream_pool import HttpConnection

MAX_PIPELINED = 16  # requests parsed ahead of the one being answered; then reading pauses
LOOPBACK = ("127.", "::1", "::ffff:127.")


class Limits(Protocol):
    """What a connection reads of its server's config (RouterConfig has every field)."""

    max_payload_size: int
    max_url_size: int
    max_header_size: int
    max_connections: int
    header_timeout_secs: float
    body_timeout_secs: float
    keep_alive_timeout_secs: float
    session_header: str


class Server(Protocol):
    """What answers the requests of a connection: its limits, the count of open connections
    (kept by the connections), and `handle`, which answers one request and never raises."""

    config: Limits
    connections: int

    async def handle(self, conn: ClientConn, req: Request) -> None: ...


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ClientConn(Responses, asyncio.Protocol):
    """One client connection; requests on it are answered in order, one at a time."""

    def __init__(self, router: Server) -> None:
        self.router, cfg = router, router.config
        self.max_body, self.max_url, self.max_head = (
            cfg.max_payload_size, cfg.max_url_size, cfg.max_header_size,
        )  # fmt: skip
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.pending: deque[Request | Refusal] = deque()
        self.refused = self.eof = self.head_only = False
        self.chunked, self.streaming, self.local = True, False, False
        self.upstream: HttpConnection | None = None  # a worker stream paused with us
        self.paused, self.keep_alive, self.now = False, True, 0.0
        self.deadline, self.timer = 0.0, None
        self.waiting: Request | None = None  # an Upgrade request whose body follows the head
        self.session_header = cfg.session_header.lower().encode()
        self._reset()

    def _reset(self) -> None:
        self.url, self.url_size, self.head_size = [], 0, 0
        self.auth, self.rid, self.body, self.size, self.session = b"", b"", [], 0, b""
        self.trace, self.api_key = b"", b""
        self.expect, self.length = False, 0

    # ----- connection life and timeouts -----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        router = self.router
        router.connections += 1
        peer = transport.get_extra_info("peername")
        self.local = bool(peer) and str(peer[0]).startswith(LOOPBACK)
        if router.connections > router.config.max_connections:
            self.refuse(503, "too many connections", b"Retry-After: 1\r\n")
            return
        self._arm(router.config.header_timeout_secs)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.router.connections -= 1
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None:
            self.task.cancel()  # aborts the upstream request too: the worker stops generating

    def _arm(self, secs: float, now: float = 0.0) -> None:
        """(Re)start the read deadline (from `now`, else the clock); one timer per connection,
        moved lazily."""
        self.deadline = (now or self.loop.time()) + secs
        if self.timer is None:
            self.timer = self.loop.call_at(self.deadline, self._expired)

    def _disarm(self) -> None:
        self.deadline = 0.0

    def _expired(self) -> None:
        self.timer = None
        if not self.deadline or self.transport is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self.deadline:
            self.timer = loop.call_at(self.deadline, self._expired)
        elif self.head_size or self.size or self.url_size:
            self.refuse(408, "request not received in time")
        else:
            self.transport.close()  # idle keep-alive connection (or one that never spoke)

    def bind(self, upstream: HttpConnection | None) -> None:
        """The worker connection now feeding this one (None when done): paused while the
        client cannot keep up."""
        self.upstream = upstream
        if upstream is not None and self.paused:
            upstream.pause_reading()

    def pause_writing(self) -> None:  # the client reads slower than the worker writes
        self.paused = True
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.upstream is not None:
            self.upstream.resume_reading()

    # ----- parsing -----

    def data_received(self, data: bytes) -> None:
        self.now = self.loop.time()  # one clock read for the deadlines the callbacks move
        if self.refused:
            return  # the rest of a refused request, read and dropped so that the answer arrives
        if self.waiting is not None:
            data = self._upgrade_body(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # Upgrade (h2c, websocket) is not offered: the request is answered over HTTP/1.1
            # and the connection goes on with a fresh parser.
            self.parser = httptools.HttpRequestParser(self)
            self.data_received(data[exc.args[0] :])
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                self.refuse(cause.status, cause.message)
            else:
                self.refuse(400, "malformed HTTP request")

    def _upgrade_body(self, data: bytes) -> bytes:
        """Bytes after an Upgrade request's head are its body (the parser stopped at the head)."""
        req, need = self.waiting, self.length - self.size
        self.size += min(need, len(data))
        self.body.append(data[:need])
        if self.size < self.length:
            return b""
        self.waiting, req.body = None, b"".join(self.body)
        self._reset()
        self._dispatch(req)
        return data[need:]

    def on_message_begin(self) -> None:
        self._arm(self.router.config.header_timeout_secs, self.now)

    def on_url(self, url: bytes) -> None:
        self.url_size += len(url)
        if self.url_size > self.max_url:
            raise _Refused(414, f"request URL longer than {self.max_url} bytes")
        self.url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value) + 4
        if self.head_size > self.max_head:
            raise _Refused(431, f"request headers larger than {self.max_head} bytes")
        name = name.lower()
        if name == b"authorization":
            self.auth = value
        elif name == b"x-request-id":
            self.rid = value
        elif name == self.session_header:
            self.session = value
        elif name == b"traceparent":
            self.trace = value
        elif name == b"x-api-key":
            self.api_key = value
        elif name == b"expect":
            self.expect = value.lower() == b"100-continue"
        elif name == b"content-length" and value.isdigit():
            self.length = int(value)
            if self.length > self.max_body:  # refused before the body is read
                raise _Refused(413, f"request body too large (limit {self.max_body} bytes)")

    def on_headers_complete(self) -> None:
        self._arm(self.router.config.body_timeout_secs, self.now)
        if self.expect:  # curl waits a second for this before it sends a body over 1 KiB
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.max_body:  # chunked bodies have no length up front
            raise _Refused(413, f"request body too large (limit {self.max_body} bytes)")
        self.body.append(body)
        self._arm(self.router.config.body_timeout_secs, self.now)

    def on_message_complete(self) -> None:
        p = self.parser
        req = Request(
            p.get_method().decode(),
            b"".join(self.url).decode("latin-1"),
            self.auth,
            b"".join(self.body),
            p.should_keep_alive(),
            request_id(self.rid),
            p.get_http_version() == "1.1",
            self.session,
            self.trace,
            self.api_key,
        )
        if p.should_upgrade():  # the parser calls an Upgrade request's connection closing
            req.keep_alive = req.http11
            if self.length and not self.body:
                self.waiting, self.size, self.body = req, 0, []
                return
        self._reset()
        self._dispatch(req)

    def _dispatch(self, item: Request | Refusal) -> None:
        self._disarm()
        if self.task is None and not self.pending:
            self.start(item)
            return
        self.pending.append(item)
        if len(self.pending) >= MAX_PIPELINED and self.transport is not None:
            self.transport.pause_reading()

    # ----- answering in order -----

    def refuse(self, status: int, message: str, headers: bytes = b"") -> None:
        """Answer with an error after the requests already queued, then end the connection."""
        self.refused = True
        path = b"".join(self.url).decode("latin-1").partition("?")[0]
        self._dispatch(Refusal(status, message, headers, path))

    def start(self, item: Request | Refusal) -> None:
        if isinstance(item, Refusal):
            self._answer_refusal(item)
            return
        self.head_only, self.keep_alive = item.method == "HEAD", item.keep_alive
        self.task = asyncio.get_running_loop().create_task(self.router.handle(self, item))
        self.task.add_done_callback(self._done)

    def _answer_refusal(self, r: Refusal) -> None:
        # Half-close rather than close: closing with unread input would reset the connection
        # and the client might never read the answer.
        body = json.dumps(error_for(r.path, r.status, r.message)).encode()
        self.head_only = False  # whatever the request before it was
        self.send(r.status, b"application/json", body, keep_alive=True, headers=r.headers)
        self.pending.clear()
        t = self.transport
        if t is not None and t.can_write_eof():
            t.write_eof()
            self.eof = True
            asyncio.get_running_loop().call_later(5.0, t.close)
        elif t is not None:
            t.close()

    def _done(self, _task: asyncio.Task[None]) -> None:
        self.task, self.upstream = None, None
        if self.transport is None:
            return
        if self.pending:
            if not self.refused:
                self.transport.resume_reading()
            self.start(self.pending.popleft())
        elif not self.refused:
            self._arm(self.router.config.keep_alive_timeout_secs)
