"""The router's HTTP/1.1 client towards workers (asyncio + httptools): pooled keep-alive
connections per worker with a connect timeout, a cap on connections, a between-bytes timeout
that pauses while the client downstream is slow, and a fresh retry when a pooled connection
turns out closed.

Why a hand-written client: aiohttp's client costs about 150 us of CPU per request on a small VM,
more than everything else the router does; this one costs about 25 us (benchmarks/router_bench).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

Headers = list[tuple[bytes, bytes]]
Sink = Callable[[bytes], None]
OnHead = Callable[[int, Headers, bool], "Sink | None"]
"""Called with (status, headers, chunked) when a response's head arrives; a returned sink gets the
body chunks as they arrive instead of the body being buffered."""


class UpstreamError(ConnectionError):
    """The worker could not be reached, or hung up before the response was complete.
    `retryable`: safe to try elsewhere (nothing or a retryable status reached the worker's
    client side); `lost`: the connection died while the worker held the request (it may have
    been the request that killed it, so it is retried at most once); `timed_out`: the worker
    was too slow (connecting, answering, or between two bytes), a 504 rather than a 502."""

    def __init__(
        self, message: str, retryable: bool = True, lost: bool = False, timed_out: bool = False
    ) -> None:
        super().__init__(message)
        self.retryable, self.lost, self.timed_out = retryable, lost, timed_out


class _Stale(Exception):
    """A pooled connection that the worker had already closed: try again on a fresh one."""


@dataclass(slots=True)
class Response:
    status: int
    headers: Headers
    body: bytes


class _Exchange:
    """One request's response being received; resolves `done` when complete or failed."""

    __slots__ = ("done", "on_head", "sink", "status", "headers", "chunks", "bind")

    def __init__(self, done: asyncio.Future[Response], on_head: OnHead | None) -> None:
        self.done, self.on_head, self.sink = done, on_head, None
        self.status, self.headers, self.chunks, self.bind = 0, [], [], None


class HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a worker, one request at a time."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        # The parser callbacks below run only while a response is expected, so `ex` is set.
        self.ex: _Exchange | None = None
        self.last, self.paused, self.got = 0.0, False, False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def pause_reading(self) -> None:
        """The client downstream is slow: stop reading, so the worker's socket fills and it
        waits (backpressure end to end); the between-chunks timeout does not run meanwhile."""
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.paused, self.last = False, time.monotonic()
        if self.transport is not None:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.last, self.got = time.monotonic(), True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamError(f"bad response from {self.pool.url}: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.forget(self)
        self.fail(UpstreamError(f"{self.pool.url} closed the connection", lost=True))

    def send(self, data: bytes, ex: _Exchange) -> None:
        self.ex, self.got, self.last = ex, False, time.monotonic()
        self.transport.write(data)

    def fail(self, exc: BaseException) -> None:
        ex, self.ex = self.ex, None
        if ex is not None and not ex.done.done():
            ex.done.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.ex.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        ex = self.ex
        ex.status = self.parser.get_status_code()
        if ex.on_head is not None:
            chunked = any(n == b"transfer-encoding" for n, _ in ex.headers)
            ex.sink = ex.on_head(ex.status, ex.headers, chunked)
            if ex.sink is not None and ex.bind is not None:
                ex.bind(self)

    def on_body(self, body: bytes) -> None:
        ex = self.ex
        if ex.sink is None:
            ex.chunks.append(body)
        else:
            ex.sink(body)

    def on_message_complete(self) -> None:
        ex, self.ex = self.ex, None
        if not ex.done.done():
            ex.done.set_result(Response(ex.status, ex.headers, b"".join(ex.chunks)))
        if self.parser.should_keep_alive():
            self.pool.release(self)
        elif self.transport is not None:
            self.transport.close()


def check_url(url: str) -> str:
    """`url` as http://host[:port][/base] without a trailing slash; ValueError if it is not one."""
    full = url.strip() if "://" in url else "http://" + url.strip()
    parts = urlsplit(full)
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise ValueError(f"worker url has a bad port: {url!r}") from None
    host = parts.hostname or ""
    if parts.scheme != "http" or not _HOST.fullmatch(host) or any(c.isspace() for c in url):
        raise ValueError(f"worker url must be http://host:port, got {url!r}")
    if parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"worker url may not carry a query, fragment or user: {url!r}")
    return full.rstrip("/")


_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.\-]{0,252})|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*")


class ConnectionPool:
    """Keep-alive connections to one worker; opens a new one whenever none is idle, up to
    `max_conns` at once (0: no cap; beyond it requests wait their turn)."""

    def __init__(
        self, url: str, max_idle: int = 256, connect_timeout: float = 5.0, max_conns: int = 0
    ) -> None:
        url = check_url(url)
        parts = urlsplit(url)
        self.url, self.host, self.port = url, parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self.max_idle, self.closed, self.connect_timeout = max_idle, False, connect_timeout
        # A counter and a queue of waiters rather than asyncio.Semaphore: the common case (a
        # slot free) then costs no coroutine, which shows in the router's requests/s.
        self.max_conns, self.busy = max_conns, 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._idle: list[HttpConnection] = []
        self._host_header = f"Host: {self.host}:{self.port}\r\n".encode()

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        on_head: OnHead | None = None,
        timeout: float | None = None,
        headers: bytes = b"",
        idle: float | None = None,
        bind: Callable[[HttpConnection | None], None] | None = None,
    ) -> Response:
        """Send one request; raises UpstreamError (unreachable, hung up, or timed out: over
        `timeout` in all, or `idle` seconds without a byte while the client keeps up).
        `headers` are extra header lines; `bind` gets the connection when a streamed body
        starts (for backpressure), and the caller unbinds it when done."""
        head = f"{method} {self.base}{path} HTTP/1.1\r\n".encode() + self._host_header + headers
        if body or method == "POST":
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        data = head + b"\r\n" + body
        if self.max_conns and self.busy >= self.max_conns:
            await self._wait_for_slot()
        self.busy += 1
        try:
            if self._idle:
                try:
                    return await self._exchange(self._idle.pop(), data, on_head, timeout, idle,
                                                bind)  # fmt: skip
                except _Stale:
                    pass  # the worker closed it while it sat idle: not the worker's failure
            conn = await self._connect(asyncio.get_running_loop())
            return await self._exchange(conn, data, on_head, timeout, idle, bind, fresh=True)
        finally:
            self.busy -= 1
            self._wake_one()

    async def _wait_for_slot(self) -> None:
        while self.busy >= self.max_conns:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken just as we gave up: pass the wake-up on
                raise

    def _wake_one(self) -> None:
        """Wake the longest waiter still waiting (a cancelled one stays queued until here)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _exchange(self, conn, data, on_head, timeout, idle, bind, fresh=False) -> Response:  # noqa: ANN001
        loop = asyncio.get_running_loop()
        ex = _Exchange(loop.create_future(), on_head)
        if conn.transport is None:
            if fresh:  # a new connection closed before the request went out: nothing was sent
                raise UpstreamError(f"{self.url} closed a new connection at once")
            raise _Stale
        ex.bind = bind
        conn.send(data, ex)
        deadline = None if timeout is None else time.monotonic() + timeout
        timer = None
        if deadline is not None or idle is not None:
            timer = loop.call_later(min(timeout or idle, idle or timeout), self._watch,
                                    conn, ex, deadline, idle)  # fmt: skip
        try:
            return await ex.done
        except UpstreamError as exc:
            if not fresh and not conn.got and exc.lost:  # lost: the worker hung up
                raise _Stale from exc
            raise
        except asyncio.CancelledError:
            conn.fail(UpstreamError("cancelled"))  # the client left: the worker should see it
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _watch(self, conn: HttpConnection, ex: _Exchange, deadline, idle) -> None:  # noqa: ANN001
        if conn.ex is not ex:
            return
        now, loop = time.monotonic(), asyncio.get_running_loop()
        if deadline is not None and now >= deadline:
            conn.fail(UpstreamError(f"{self.url} timed out", retryable=False, timed_out=True))
            return
        if idle is not None and not conn.paused and now - conn.last >= idle:
            why = f"{self.url} sent nothing for {idle:g} s"
            conn.fail(UpstreamError(why, retryable=False, timed_out=True))
            return
        wake = now + idle if idle is not None and conn.paused else conn.last + (idle or 1e9)
        wake = min(wake, deadline or wake)
        ex_timer = loop.call_later(max(wake - now, 0.001), self._watch, conn, ex, deadline, idle)
        ex.done.add_done_callback(lambda _f: ex_timer.cancel())

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> HttpConnection:
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: HttpConnection(self), self.host, self.port),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise UpstreamError(
                f"cannot connect to {self.url}: timed out", timed_out=True
            ) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {self.url}: {exc}") from exc
        return conn

    def release(self, conn: HttpConnection) -> None:
        if self.closed or len(self._idle) >= self.max_idle:
            conn.transport.close()
        else:
            self._idle.append(conn)

    def forget(self, conn: HttpConnection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        """Close idle connections now; busy ones close when their response completes."""
        self.closed = True
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()
