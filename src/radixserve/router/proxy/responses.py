"""Writing the router's answers to a client connection: a whole response (plain or JSON, head only
for HEAD), a streamed one (chunked for HTTP/1.1, close-delimited for HTTP/1.0) and its error
ending, and the worker's response headers worth passing back."""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import TYPE_CHECKING

from radixserve.router.proxy.errors import stream_end

if TYPE_CHECKING:
    from radixserve.router.proxy.upstream_pool import Headers

REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class Responses:
    """ClientConn's writing side (mixed into it; connections.py owns the state below and
    decides when each answer starts)."""

    transport: asyncio.Transport | None
    eof: bool  # the connection was half-closed after a refusal: nothing more is written
    head_only: bool  # the request being answered is a HEAD
    keep_alive: bool  # the request's client keeps the connection open
    streaming: bool
    chunked: bool

    def send(
        self,
        status: int,
        ctype: bytes | None,
        body: bytes,
        keep_alive: bool = True,
        headers: bytes = b"",
    ) -> None:
        """A whole response; `ctype` None when `headers` carry the Content-Type. The connection
        stays open only if both the caller and the request's client want it."""
        keep_alive = keep_alive and self.keep_alive
        if ctype is not None:
            headers = b"Content-Type: %s\r\n%b" % (ctype, headers)
        head = b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\n%b" % (
            (status, REASONS.get(status, b""), len(body), headers)
        )
        head += b"\r\n" if keep_alive else b"Connection: close\r\n\r\n"
        self.write(head if self.head_only else head + body)
        if not keep_alive and self.transport is not None:
            self.transport.close()

    def send_json(
        self, status: int, obj: object, keep_alive: bool = True, headers: bytes = b""
    ) -> None:
        self.send(status, b"application/json", json.dumps(obj).encode(), keep_alive, headers)

    def begin_stream(self, status: int, headers: bytes, http11: bool) -> None:
        """Start a streamed answer; `headers` are complete header lines, Content-Type included."""
        self.streaming, self.chunked = True, http11
        framing = b"Transfer-Encoding: chunked\r\n" if http11 else b"Connection: close\r\n"
        self.write(
            b"HTTP/1.1 %d %s\r\n%b%bCache-Control: no-cache\r\n\r\n"
            % (status, REASONS.get(status, b""), headers, framing)
        )

    def chunk(self, data: bytes) -> None:
        if data:
            self.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    def end_stream(self, keep_alive: bool) -> None:
        self.streaming, keep_alive = False, keep_alive and self.keep_alive
        if self.chunked:
            self.write(b"0\r\n\r\n")
        if (not keep_alive or not self.chunked) and self.transport is not None:
            self.transport.close()

    def abort_stream(self, status: int, message: str, keep_alive: bool, path: str) -> None:
        """End a stream that cannot go on with the error event of the API at `path`, then a
        properly ended body (no error page inside the event stream)."""
        self.chunk(stream_end(path, status, message))
        self.end_stream(keep_alive)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.eof:
            self.transport.write(data)


# Hop-by-hop headers and those the router writes itself are not passed back.
_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length",
                  b"te", b"trailer", b"upgrade", b"proxy-authenticate", b"x-request-id"})  # fmt: skip


def passback(headers: Headers, rid: str) -> bytes:
    """The worker's response headers worth passing to the client, as header lines."""
    lines = [n + b": " + v + b"\r\n" for n, v in headers if n not in _HOP]
    if not any(n == b"content-type" for n, _ in headers):
        lines.append(b"Content-Type: application/json\r\n")
    return b"".join(lines) + b"X-Request-Id: " + rid.encode() + b"\r\n"
