"""The router's HTTP/1.1 protocol handling (asyncio + httptools): parsing client connections,
answering requests in order, and writing plain, JSON and chunked responses. Proxy logic lives in
app.py; nothing here knows about workers or policies."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING

import httptools

if TYPE_CHECKING:
    from radixserve.router.app import Router

REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


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
