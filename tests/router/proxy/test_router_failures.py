"""The router when workers fail (issue 6, acceptance 2-3): retries with backoff up to a limit and
then a clear error, what is never retried, the circuit breaker taking a dead worker out of
routing and letting it back, and a stream whose worker dies part-way."""

from __future__ import annotations

import http.client
import json
import time

import pytest

pytest.importorskip("httptools")

from radixserve.router.proxy.app import Router  # noqa: E402
from radixserve.router.proxy.config import RouterConfig  # noqa: E402
from test_router_app import (  # noqa: E402
    FakeWorker,
    RouterThread,
    call,
    generate,
    make_router,  # noqa: F401  (fixture)
    wait_for,
    workers,  # noqa: F401  (fixture)
)


def metric(r: RouterThread, name: str) -> float:
    text = call("GET", r.addr, "/metrics")[1]
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")))


def counts(r: RouterThread) -> dict[str, dict]:
    return {w["id"]: w for w in call("GET", r.addr, "/workers")[1]["workers"]}


@pytest.fixture
def heal(workers):  # noqa: F811
    """Clears injected failures on the shared workers after the test, whatever happened."""
    yield
    for w in workers:
        w.post("/fake/fail", {"count": 0})


def test_backoff_doubles_up_to_its_cap_with_jitter():
    router = Router(RouterConfig(retry_backoff_ms=10, retry_max_backoff_ms=50))
    for attempt, base in zip((1, 2, 3, 4, 9), (0.01, 0.02, 0.04, 0.05, 0.05)):
        waits = {router._backoff(attempt) for _ in range(50)}
        assert all(base <= w <= 1.5 * base for w in waits) and len(waits) > 1  # jittered


def test_retries_stop_at_the_limit_with_a_clear_error(workers, make_router, heal):  # noqa: F811
    r = make_router([w.url for w in workers], max_retries=2, retry_backoff_ms=100)
    for w in workers:
        w.post("/fake/fail", {"count": 5, "status": 503})
    t0 = time.monotonic()
    status, body = generate(r.addr, "doomed")
    waited = time.monotonic() - t0
    assert status == 502 and body["error"]["type"] == "service_unavailable"
    assert "3 attempt(s)" in body["error"]["message"]  # the first try and max_retries=2 more
    assert metric(r, "radixserve_router_retries_total") == 2
    assert waited >= 0.1 + 0.2  # the backoffs were waited out (a lower bound: cannot flake)
    assert sum(w["errors"] for w in counts(r).values()) == 3
    assert metric(r, 'radixserve_router_failed_requests_total{code="502"}') == 1


def test_client_errors_are_passed_through_not_retried(workers, make_router, heal):  # noqa: F811
    r = make_router([w.url for w in workers[:2]], policy="round_robin")
    workers[0].post("/fake/fail", {"count": 1, "status": 400})
    workers[1].post("/fake/fail", {"count": 1, "status": 400})
    status, body = generate(r.addr, "bad")
    assert status == 400 and body["error"]["message"] == "injected failure"
    assert metric(r, "radixserve_router_retries_total") == 0
    assert all(w["errors"] == 0 for w in counts(r).values())  # the worker is not to blame


def test_a_stream_that_fails_before_its_first_byte_is_retried(
    workers,  # noqa: F811
    make_router,  # noqa: F811
    heal,
):
    r = make_router([w.url for w in workers[:2]], policy="round_robin", retry_backoff_ms=1)
    workers[0].post("/fake/fail", {"count": 1, "status": 503, "chunked": True})
    for _ in range(2):  # round robin: one of the two lands on the failing worker first
        conn = http.client.HTTPConnection(r.addr, timeout=10)
        conn.request("POST", "/generate", json.dumps({"text": "s", "stream": True}))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read().decode().endswith("data: [DONE]\n\n")
    assert metric(r, "radixserve_router_retries_total") == 1


def test_a_stream_cut_by_a_dying_worker_ends_with_an_error_event_then_done(make_router):  # noqa: F811
    slow = FakeWorker("dying", "--token-delay-ms", "30")
    r = make_router([slow.url])
    conn = http.client.HTTPConnection(r.addr, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 200,
                                                         "stream": True}))  # fmt: skip
    resp = conn.getresponse()
    received = resp.read1(65536)
    slow.kill()
    received += resp.read()  # a properly ended chunked body: no IncompleteRead
    events = [e for e in received.decode().split("\n\n") if e.strip()]
    assert json.loads(events[0][6:])["choices"][0]["text"] == " t0"
    # As vLLM and smg: the error event, then [DONE] (not a dropped connection).
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "bad_gateway" and "mid-stream" in error["message"]
    assert events[-1] == "data: [DONE]"


def test_circuit_breaker_takes_a_dead_worker_out_and_lets_it_back(workers, make_router):  # noqa: F811
    flaky = FakeWorker("flaky")
    r = make_router(
        [workers[0].url, flaky.url],
        policy="round_robin",
        retry_backoff_ms=1,
        cb_failure_threshold=2,
        cb_timeout_duration_secs=3.0,
    )
    flaky.kill()
    assert all(generate(r.addr, f"k{i}")[0] == 200 for i in range(10))
    info = counts(r)["w2"]
    # Two failures opened the circuit; the next eight requests did not even try it.
    assert info["circuit"] == "open" and info["errors"] == 2
    back = FakeWorker("flaky", "--port", str(flaky.port))
    try:
        # After the open window a trial request goes through and the circuit closes.
        served = lambda: generate(r.addr, "again")[1]["meta_info"]["worker"] == "flaky"  # noqa: E731
        assert wait_for(lambda: served() or served(), 10)
        assert counts(r)["w2"]["circuit"] == "closed"
    finally:
        back.kill()
