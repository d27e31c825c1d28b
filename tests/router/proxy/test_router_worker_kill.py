"""A worker that dies under the router (issue 25): a pooled connection found closed is retried on
a fresh one, and when the fresh one fails too that is the usual upstream failure (retried on
another worker, or a 502), never an internal error; and the issue's scenario end to end."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import pytest

pytest.importorskip("httptools")

from radixserve.router.proxy.upstream_pool import ConnectionPool, UpstreamError  # noqa: E402
from test_router_fleet import fleet  # noqa: E402, F401  (fixture)

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def dying_worker(listener: socket.socket) -> None:
    """Answers one request on the first connection, then hangs up on the next request there
    (the pooled connection is stale) and closes every later connection as soon as it opens."""
    first = True
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # the test closed the listener
        if first:
            first = False
            conn.recv(65536)
            conn.sendall(OK)
            conn.recv(65536)  # the second request on the kept-alive connection: no answer
        conn.close()


async def stale_then_fresh_fails() -> BaseException | None:
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=dying_worker, args=(listener,), daemon=True).start()
    pool = ConnectionPool(f"http://127.0.0.1:{listener.getsockname()[1]}")
    loop, busy = asyncio.get_running_loop(), [True]

    def stutter() -> None:
        """A router busy with other requests: each turn of its loop takes a moment, so the
        worker's close of the fresh connection is seen before the request is written."""
        if busy[0]:
            time.sleep(0.002)
            loop.call_soon(stutter)

    try:
        assert (await pool.request("GET", "/health")).status == 200
        loop.call_soon(stutter)
        try:
            await pool.request("POST", "/generate", b"{}", timeout=10)
        except BaseException as exc:  # noqa: BLE001  (what escapes is the subject here)
            return exc
        return None
    finally:
        busy[0] = False
        pool.close()
        listener.close()


def test_stale_connection_then_failing_fresh_one_is_an_upstream_error():
    for _ in range(10):  # the fresh connection may close before or after the request is sent
        exc = asyncio.run(stale_then_fresh_fails())
        assert isinstance(exc, UpstreamError), repr(exc)
        assert exc.retryable and not exc.timed_out  # the router tries another worker


PREFIX_CHARS, GROUPS = 3000, 8


def body(i: int, prefixes: list[str]) -> bytes:
    text = prefixes[i % GROUPS] + f" question {i}?"
    return json.dumps({"text": text, "sampling_params": {"max_new_tokens": 8}}).encode()


async def load(addr: str, n: int, concurrency: int, kill_at: int, kill) -> list:  # noqa: ANN001
    rng = random.Random(0)
    words = ("alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "lambda")
    prefixes = [
        (f"group {g}:" + "".join(" " + rng.choice(words) for _ in range(PREFIX_CHARS)))[
            :PREFIX_CHARS
        ]
        for g in range(GROUPS)
    ]
    pool, statuses, todo = ConnectionPool(f"http://{addr}"), [], iter(range(n))

    async def user() -> None:
        for i in todo:
            if i == kill_at:
                await asyncio.to_thread(kill)
            try:
                resp = await pool.request("POST", "/generate", body(i, prefixes), timeout=120)
            except (ConnectionError, TimeoutError) as exc:
                statuses.append(type(exc).__name__)
                continue
            statuses.append(resp.status)

    await asyncio.gather(*(user() for _ in range(concurrency)))
    pool.close()
    return statuses


def test_a_worker_killed_at_request_120_of_240_fails_none(fleet):  # noqa: F811
    """The issue's scenario: 3 `serve --sim` workers behind cache_aware (default settings),
    240 /generate at concurrency 16 with 3,000-character shared prefixes, one SIGKILLed."""
    workers = fleet(3)
    router = fleet.router([w.url for w in workers], "--policy", "cache_aware")
    statuses = asyncio.run(load(router.addr, 240, 16, 120, workers[0].kill))
    failed = [s for s in statuses if s != 200]
    assert len(statuses) == 240 and failed == [], failed
    assert not any("Traceback" in line for line in router.lines), "".join(router.lines[-40:])
