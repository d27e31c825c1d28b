"""The router's side towards workers (issue 15): connect and between-chunk timeouts, per-worker
connection caps, a pooled connection the worker closed, health probes bounded in time, the
half-open breaker's single trial, which failures are retried, worker URL checks and the
Prometheus text. Misbehaving workers are small raw servers in this file."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("httptools")

from prometheus_client import CONTENT_TYPE_LATEST  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from radixserve.router.proxy.config import HealthConfig  # noqa: E402
from radixserve.router.proxy.upstream_pool import ConnectionPool  # noqa: E402
from radixserve.router.proxy.workers import CircuitBreaker, WorkerRegistry  # noqa: E402
from test_router_app import (  # noqa: E402
    FakeWorker,
    call,
    generate,
    make_router,  # noqa: F401  (fixture)
    workers,  # noqa: F401  (fixture)
)


@pytest.fixture
def blackhole():
    """A loopback address that drops connection attempts, as a host that drops packets: a
    listener whose accept queue is full (the kernel ignores further SYNs)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    port = lst.getsockname()[1]
    filler = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        filler.append(s)
    time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    for s in [*filler, lst]:
        s.close()


class RawWorker:
    """A worker that answers /health and then misbehaves on generation requests:
    'stale' answers the first request on a connection and closes it on the second (as a
    worker closing an idle keep-alive connection just as the router reuses it);
    'crash' drops the connection on every generation request (a request that kills it)."""

    OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok": true}'

    def __init__(self, mode: str) -> None:
        self.mode, self.generations = mode, 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(5)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        server = self.loop.run_until_complete(
            asyncio.start_server(self._conn, "127.0.0.1", 0)
        )  # fmt: skip
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                               if h.lower().startswith(b"content-length")), 0)  # fmt: skip
                await reader.readexactly(length)
                if head.startswith(b"POST"):
                    self.generations += 1
                    if self.mode == "crash" or (self.mode == "stale" and served):
                        break
                writer.write(self.OK.replace(b"11", b"12"))
                served += 1
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_connect_timeout_and_probes_bounded_by_their_timeout(blackhole, workers, make_router):  # noqa: F811
    r = make_router([blackhole, workers[0].url], policy="round_robin", connect_timeout_secs=0.3,
                    retry_backoff_ms=1)  # fmt: skip
    # Each request that lands on the dead host waits 0.3 s, not two minutes, then moves on.
    assert all(generate(r.addr, f"q{i}")[0] == 200 for i in range(4))
    health = HealthConfig(
        health_check_timeout_secs=0.5, health_failure_threshold=1, connect_timeout_secs=30
    )

    async def sweep() -> list[bool]:
        reg = WorkerRegistry(health, lambda _id: None)
        dead, live = reg.add(blackhole), reg.add(workers[0].url)
        await asyncio.wait_for(reg.check_all(), 10)  # the probe's own timeout bounds connecting
        await reg.stop()
        return [dead.healthy, live.healthy]

    assert asyncio.run(sweep()) == [False, True]


def test_a_worker_silent_between_chunks_ends_the_stream(make_router):  # noqa: F811
    slow = FakeWorker("silent", "--token-delay-ms", "2000")
    try:
        r = make_router([slow.url], stream_timeout_secs=0.3)
        body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 3}}
        status, text = call("POST", r.addr, "/generate", body)
    finally:
        slow.kill()
    events = [e for e in text.split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert "sent nothing for 0.3 s" in json.loads(events[-2][6:])["error"]["message"]


def test_per_worker_connection_cap_queues_requests(make_router):  # noqa: F811
    slow = FakeWorker("capped", "--token-delay-ms", "50")
    try:
        r = make_router([slow.url], max_worker_connections=2)
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(generate(r.addr, "c")[0]))
                   for _ in range(6)]  # fmt: skip
        for t in threads:
            t.start()
        peak = 0
        while any(t.is_alive() for t in threads):
            peak = max(peak, call("GET", slow.url[7:], "/get_load")[1]["num_reqs"])
            time.sleep(0.01)
    finally:
        slow.kill()
    assert results == [200] * 6 and 1 <= peak <= 2


def test_a_waiter_woken_as_it_is_cancelled_passes_the_slot_on():
    async def scenario() -> None:
        pool = ConnectionPool("http://127.0.0.1:1", max_conns=1)
        pool.busy = 1  # the one connection is in use
        a, b, c = (asyncio.create_task(pool._wait_for_slot()) for _ in range(3))
        await asyncio.sleep(0)
        b.cancel()  # gives up while waiting: its future stays queued behind a's
        await asyncio.sleep(0)
        pool.busy = 0
        pool._waiters.popleft().set_result(None)  # the slot frees: a is woken...
        a.cancel()  # ...and cancelled before it runs, so it must wake the next one
        results = await asyncio.gather(a, b, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        await asyncio.wait_for(c, 1)  # c got the slot, skipping b's cancelled turn

    asyncio.run(scenario())


def test_a_pooled_connection_the_worker_closed_is_retried_fresh(make_router):  # noqa: F811
    stale = RawWorker("stale")
    try:
        r = make_router([stale.url])
        assert [generate(r.addr, f"s{i}")[0] for i in range(3)] == [200, 200, 200]
        info = call("GET", r.addr, "/workers")[1]["workers"][0]
    finally:
        stale.stop()
    assert info["errors"] == 0 and info["circuit"] == "closed"  # not the worker's failure
    assert "radixserve_router_retries_total 0.0" in call("GET", r.addr, "/metrics")[1]


def test_a_request_that_kills_workers_kills_at_most_two(make_router):  # noqa: F811
    crashers = [RawWorker("crash") for _ in range(4)]
    try:
        r = make_router([c.url for c in crashers], policy="round_robin", retry_backoff_ms=1)
        status, body = generate(r.addr, "poison")
    finally:
        for c in crashers:
            c.stop()
    assert status == 502 and "2 attempt(s)" in body["error"]["message"]
    assert sum(c.generations for c in crashers) == 2


def test_a_500_is_passed_back_not_retried(workers, make_router):  # noqa: F811
    r = make_router([w.url for w in workers[:2]], policy="round_robin", retry_backoff_ms=1)
    workers[0].post("/fake/fail", {"count": 1, "status": 500})
    try:
        statuses = sorted(generate(r.addr, f"f{i}")[0] for i in range(2))
    finally:
        workers[0].post("/fake/fail", {"count": 0})
    assert statuses == [200, 500]
    assert "radixserve_router_retries_total 0.0" in call("GET", r.addr, "/metrics")[1]


def test_half_open_breaker_lets_one_trial_through():
    b = CircuitBreaker(failure_threshold=1, success_threshold=1, open_secs=1.0)
    b.record(False, now=0.0)
    assert not b.allows(0.5)
    assert b.allows(1.5)
    b.dispatched()
    assert not b.allows(1.6)  # the trial is under way: nobody else
    b.settled()
    b.record(True, 1.7)
    assert b.state == "closed" and b.allows(1.8)


def test_worker_urls_are_checked_deduplicated_and_probed(workers, make_router):  # noqa: F811
    r = make_router([workers[0].url])
    for bad in ("http://not a url", "http://", "https://x:1", "http://h:99999", "http://h:1?x=1"):
        status, body = call("POST", r.addr, "/workers", {"url": bad})
        assert status == 400 and body["error"]["code"] == "bad_request", bad
    assert call("POST", r.addr, "/add_worker?url=http://")[0] == 400
    port = workers[0].url.rsplit(":", 1)[1]
    assert call("POST", r.addr, "/workers", {"url": f"http://localhost:{port}"})[0] == 409
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    status, added = call("POST", r.addr, "/workers", {"url": dead})
    assert status == 201 and added["healthy"] is False  # not listed healthy before traffic
    assert call("GET", r.addr, "/readiness")[1]["healthy_workers"] == 1


def test_metrics_are_valid_prometheus_text(workers, make_router):  # noqa: F811
    r = make_router([workers[0].url])
    generate(r.addr, "m")
    status, text = call("GET", r.addr, "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert status == 200 and families["radixserve_router_requests"].type == "counter"
    sample = families["radixserve_router_requests"].samples[0]
    assert sample.labels == {"worker": workers[0].url} and sample.value == 1.0
    assert families["radixserve_router_decision_seconds"].type == "histogram"
    conn = http.client.HTTPConnection(r.addr, timeout=10)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    resp.read()
    assert resp.getheader("Content-Type") == CONTENT_TYPE_LATEST  # prometheus-client's own


@pytest.mark.parametrize(
    "flags",
    [["--max-url-size", "0"], ["--warmup-secs", "-1"], ["--worker-urls", "http://not a url"]],
)
def test_bad_flags_are_one_line_not_a_traceback(flags):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "radixserve", "route", "--port", "0", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("radixserve route: ") and out.stderr.count("\n") == 1


def test_a_worker_silent_before_its_answer_is_a_gateway_timeout(make_router):  # noqa: F811
    slow = FakeWorker("mute", "--token-delay-ms", "2000")
    try:
        r = make_router([slow.url], stream_timeout_secs=0.3)
        status, body = call("POST", r.addr, "/generate", {"text": "x"})
    finally:
        slow.kill()
    assert status == 504, body  # the worker was too slow: not a bad gateway
    assert "request failed" in body["error"]["message"]
