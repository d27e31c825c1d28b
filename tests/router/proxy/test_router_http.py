"""The router's HTTP/1.1 face probed over raw sockets, as a hostile or merely unusual client would
(issue 15): Upgrade, size limits, timeouts, the connection cap, pipelining with a bad follow-up,
status lines, HEAD, HTTP/1.0, 405 and backpressure. A client library would hide most of these."""

from __future__ import annotations

import gc
import json
import re
import socket
import time

import pytest

pytest.importorskip("httptools")

from radixserve.router.proxy.config import RouterConfig  # noqa: E402
from radixserve.router.proxy.connections import ClientConn  # noqa: E402
from radixserve.server.config import ServerConfig  # noqa: E402
from test_router_app import (  # noqa: E402
    FakeWorker,
    make_router,  # noqa: F401  (fixture)
    wait_for,
    workers,  # noqa: F401  (fixture)
)


def connect(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the router closes (or half-closes) the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def exchange(addr: str, data: bytes) -> bytes:
    with connect(addr) as s:
        s.sendall(data)
        return read_all(s)


def heads(raw: bytes) -> list[bytes]:
    """The status lines found in a byte stream of responses."""
    return re.findall(rb"HTTP/1\.[01] \d{3}[^\r]*", raw)


def post(path: str, obj: object, extra: bytes = b"", close: bool = False) -> bytes:
    body = json.dumps(obj).encode()
    conn = b"Connection: close\r\n" if close else b""
    return b"POST %s HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n%b%b\r\n%b" % (
        path.encode(), len(body), conn, extra, body,
    )  # fmt: skip


def test_an_upgrade_request_is_answered_over_http11(workers, make_router):  # noqa: F811
    r = make_router([workers[0].url])
    upgrade = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n"
    raw = exchange(
        r.addr,
        b"GET /health HTTP/1.1\r\nHost: r\r\n" + upgrade + b"\r\n"
        + post("/generate", {"text": "hi", "max_new_tokens": 2}, upgrade)
        + b"GET /liveness HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
    )  # fmt: skip
    assert [h[:12] for h in heads(raw)] == [b"HTTP/1.1 200"] * 3
    assert b'"text": " t0 t1"' in raw  # the body sent after an Upgrade head was not lost


def test_url_and_head_size_limits(make_router):  # noqa: F811
    r = make_router([], max_url_size=4096, max_header_size=8192)
    raw = exchange(r.addr, b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: r\r\n\r\n")
    assert heads(raw)[0].startswith(b"HTTP/1.1 414")
    raw = exchange(r.addr, b"GET /health HTTP/1.1\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n")
    assert heads(raw)[0].startswith(b"HTTP/1.1 431")
    # A huge URL is refused once past the limit, not read (and joined) to its end.
    with connect(r.addr) as s:
        s.sendall(b"GET /" + b"c" * 65536)
        assert s.recv(4096).startswith(b"HTTP/1.1 414")
    assert exchange(r.addr, b"GET /liveness HTTP/1.1\r\nConnection: close\r\n\r\n")[9:12] == b"200"


def test_header_read_and_keep_alive_idle_timeouts(make_router):  # noqa: F811
    r = make_router([], header_timeout_secs=0.3, keep_alive_timeout_secs=0.3)
    with connect(r.addr) as s:  # slowloris: a head that never ends
        s.sendall(b"GET /liveness HTTP/1.1\r\nX-a: 1\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 408")
    with connect(r.addr) as s:  # an idle keep-alive connection after one answer
        s.sendall(b"GET /liveness HTTP/1.1\r\n\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 200")  # then closed: recv returned b""
    assert r.router.connections == 0 or wait_for(lambda: r.router.connections == 0, 5)


def test_connections_beyond_the_cap_get_503_and_the_rest_are_served(make_router):  # noqa: F811
    r = make_router([], max_connections=3)
    held = [connect(r.addr) for _ in range(3)]
    assert wait_for(lambda: r.router.connections == 3, 5)
    raw = exchange(r.addr, b"GET /liveness HTTP/1.1\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in raw
    held[0].sendall(b"GET /liveness HTTP/1.1\r\n\r\n")
    assert held[0].recv(4096).startswith(b"HTTP/1.1 200")  # those admitted are served
    for s in held:
        s.close()
    assert wait_for(lambda: r.router.connections == 0, 5)
    assert exchange(r.addr, b"GET /liveness HTTP/1.1\r\nConnection: close\r\n\r\n")[9:12] == b"200"


def test_the_body_limit_is_the_servers(make_router):  # noqa: F811
    assert RouterConfig().max_payload_size == ServerConfig().max_payload_size
    r = make_router([], max_payload_size=1000)
    raw = exchange(r.addr, post("/generate", {"text": "x" * 2000}))
    assert raw.startswith(b"HTTP/1.1 413")
    chunked = b"POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    raw = exchange(r.addr, chunked + b"".join(b"200\r\n" + b"y" * 512 + b"\r\n" for _ in range(3)))
    assert raw.startswith(b"HTTP/1.1 413")


def test_a_bad_request_pipelined_after_a_stream_is_answered_after_it(make_router):  # noqa: F811
    slow = FakeWorker("pipe", "--token-delay-ms", "20")
    try:
        r = make_router([slow.url])
        stream = post("/v1/completions", {"prompt": "p", "max_tokens": 5, "stream": True})
        raw = exchange(r.addr, stream + b"GARBAGE / HTTP/1.1\r\n\r\n")
        first, _, rest = raw.partition(b"0\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200 OK") and b"data: [DONE]" in first
        assert b"HTTP/1.1 400" not in first  # no error page inside the event stream
        assert rest.startswith(b"HTTP/1.1 400") and b'"code": "bad_request"' in rest
        # Non-streaming, with an oversized follow-up: the first gets its own answer.
        r2 = make_router([slow.url], max_payload_size=200)
        raw = exchange(r2.addr, post("/generate", {"text": "a"}) + post("/generate", "z" * 300))
        assert [h[:12] for h in heads(raw)] == [b"HTTP/1.1 200", b"HTTP/1.1 413"]
        assert b'"text": " t0 t1 t2 t3"' in raw.split(b"HTTP/1.1 413")[0]
    finally:
        slow.kill()


def test_an_error_after_a_stream_started_ends_it_cleanly(make_router):  # noqa: F811
    slow = FakeWorker("boom", "--token-delay-ms", "10")
    try:
        r = make_router([slow.url])

        def broken_hook(*args: object) -> None:  # a policy bug surfacing after the stream
            raise RuntimeError("policy bug")

        r.router.policy.on_complete = broken_hook
        stream = post("/v1/completions", {"prompt": "p", "max_tokens": 3, "stream": True})
        raw = exchange(r.addr, stream)
    finally:
        slow.kill()
    assert heads(raw) == [b"HTTP/1.1 200 OK"]  # no 500 written into the body
    body = raw.split(b"\r\n\r\n", 1)[1]
    assert body.endswith(b"0\r\n\r\n") and b"internal router error" in body
    assert body.index(b'"error"') < body.rindex(b"data: [DONE]")


def test_status_line_head_http10_and_405(workers, make_router):  # noqa: F811
    r = make_router([workers[0].url])
    workers[0].post("/fake/fail", {"count": 1, "status": 429, "chunked": True})
    raw = exchange(r.addr, post("/generate", {"text": "s", "stream": True}, close=True))
    assert raw.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")  # a stream's status, as it is
    raw = exchange(r.addr, b"HEAD /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"\r\n\r\n")  # head only
    req = b"POST /generate HTTP/1.0\r\nContent-Length: 41\r\n\r\n"
    raw = exchange(r.addr, req + b'{"text": "old", "stream": true, "a": 123}')
    head, body = raw.split(b"\r\n\r\n", 1)
    assert b"chunked" not in head.lower() and body.endswith(b"data: [DONE]\n\n")
    raw = exchange(r.addr, b"GET /generate HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 405") and b"Allow: POST\r\n" in raw
    raw = exchange(r.addr, b"PUT /workers HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 405") and b"Allow: GET, POST\r\n" in raw


def test_a_slow_reader_is_not_buffered_in_router_memory(make_router):  # noqa: F811
    fast = FakeWorker("firehose")
    try:
        r = make_router([fast.url])
        with connect(r.addr) as s:
            # About 30 MB of SSE: more than the kernel's socket buffers on both sides hold.
            body = {"prompt": "p", "max_tokens": 300_000, "stream": True}
            s.sendall(post("/v1/completions", body))
            s.recv(1024)

            def buffered() -> int:
                conns = [o for o in gc.get_objects() if isinstance(o, ClientConn)]
                return max((c.transport.get_write_buffer_size() for c in conns if c.transport),
                           default=0)  # fmt: skip

            # We read nothing for 3 s: the worker has it all ready, yet the router holds
            # little of it (the stream is paused at the worker instead).
            peak, deadline = 0, time.monotonic() + 3.0
            while time.monotonic() < deadline and peak < 2**20:
                peak = max(peak, buffered())
                time.sleep(0.2)
            assert peak < 2**20
            got = 0
            while chunk := s.recv(1 << 20):  # and it all arrives once the client reads
                got += len(chunk)
                if chunk.endswith(b"0\r\n\r\n"):
                    break
            assert got > 25_000_000
    finally:
        fast.kill()


def test_a_large_body_is_parsed_off_the_event_loop(workers, make_router, monkeypatch):  # noqa: F811
    import asyncio
    import threading

    threads: list[str] = []
    original = asyncio.to_thread

    async def watched(func, *args, **kwargs):  # noqa: ANN001, ANN202
        def run():  # noqa: ANN202
            threads.append(threading.current_thread().name)
            return func(*args, **kwargs)

        return await original(run)

    monkeypatch.setattr(asyncio, "to_thread", watched)
    r = make_router([workers[0].url])
    small = exchange(r.addr, post("/generate", {"text": "short"}, close=True))
    assert small.startswith(b"HTTP/1.1 200") and threads == []  # small: parsed inline
    big = exchange(r.addr, post("/generate", {"text": "x" * 3_000_000}, close=True))
    assert big.startswith(b"HTTP/1.1 200") and len(threads) == 1
    assert threads[0] != r.thread.name  # not the event loop's thread
