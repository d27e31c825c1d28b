"""The router's protections (issue 15): a cap on requests in flight with a bounded queue and a
503 with Retry-After beyond it, and session affinity on a header (consistent_hashing)."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("httptools")

from radixserve.router.policies.base import RequestView, WorkerView  # noqa: E402
from radixserve.router.policies.registry import create_policy  # noqa: E402
from radixserve.router.proxy.config import HealthConfig  # noqa: E402
from radixserve.router.proxy.workers import WorkerRegistry  # noqa: E402
from test_router_app import (  # noqa: E402
    FakeWorker,
    call,
    generate,
    make_router,  # noqa: F401  (fixture)
    wait_for,
    workers,  # noqa: F401  (fixture)
)
from test_router_http import connect, post, read_all  # noqa: E402


def test_requests_beyond_the_cap_and_the_queue_get_503_with_retry_after(make_router):  # noqa: F811
    slow = FakeWorker("capped", "--token-delay-ms", "150")
    try:
        r = make_router([slow.url], max_concurrent_requests=2, queue_size=1)
        socks = [connect(r.addr) for _ in range(5)]
        for i, s in enumerate(socks[:3]):  # two take the slots, one waits in the queue
            s.sendall(post("/generate", {"text": f"q{i}"}, close=True))
        assert wait_for(lambda: r.router.admission.queued == 1, 10)
        for i, s in enumerate(socks[3:]):
            s.sendall(post("/generate", {"text": f"x{i}"}, close=True))
        answers = [read_all(s) for s in socks]
    finally:
        slow.kill()
    statuses = [a[9:12] for a in answers]
    assert statuses == [b"200"] * 3 + [b"503"] * 2
    assert all(b"Retry-After: 1\r\n" in a and b'"code": "overloaded"' in a for a in answers[3:])
    metrics = call("GET", r.addr, "/metrics")[1]
    assert 'radixserve_router_failed_requests_total{code="503"} 2.0' in metrics


def test_a_queued_request_waits_at_most_the_queue_timeout(make_router):  # noqa: F811
    slow = FakeWorker("slow", "--token-delay-ms", "500")
    try:
        r = make_router([slow.url], max_concurrent_requests=1, queue_timeout_secs=0.2)
        first = threading.Thread(target=generate, args=(r.addr, "long"))
        first.start()
        assert wait_for(lambda: r.router.admission.active == 1, 10)
        status, body = generate(r.addr, "waits")
        first.join()
    finally:
        slow.kill()
    assert status == 503 and body["error"]["code"] == "overloaded"
    assert r.router.admission.active == 0 and r.router.admission.queued == 0  # no slot leaked


def test_consistent_hashing_keeps_sessions_and_moves_few_on_scaling():
    policy = create_policy("consistent_hashing")
    fleet = [WorkerView(f"w{i}") for i in range(4)]
    views = [RequestView(b"prompt", routing_key=f"user-{i}".encode()) for i in range(400)]
    before = [policy.select(fleet, v, 0.0) for v in views]
    assert len(set(before)) == 4  # spread over the fleet
    assert before == [policy.select(fleet, v, 1.0) for v in views]  # sticky
    down = [*fleet[:3], WorkerView("w3", healthy=False)]
    after = [policy.select(down, v, 2.0) for v in views]
    moved = [b for b, a in zip(before, after) if a != b]
    assert moved and set(moved) == {3}  # only the sessions of the worker that left moved


def test_consistent_hashing_on_the_session_header_end_to_end(workers, make_router):  # noqa: F811
    r = make_router([w.url for w in workers], policy="consistent_hashing")
    served = {}
    for session in ("alice", "bob", "carol", "dave", "erin", "frank"):
        homes = {
            call("POST", r.addr, "/generate", {"text": f"turn {i}"}, {"X-Session-Id": session})[1][
                "meta_info"
            ]["worker"]
            for i in range(4)
        }
        assert len(homes) == 1  # every turn of a session on one worker, whatever its prompt
        served[session] = homes.pop()
    assert len(set(served.values())) > 1


def test_overloaded_workers_are_steered_away_from_then_shed(workers, make_router):  # noqa: F811
    a, b = workers[:2]
    r = make_router([a.url, b.url], policy="round_robin", health_check_interval_secs=0.1,
                    overload_waiting_threshold=10)  # fmt: skip
    try:
        a.post("/fake/load", {"num_waiting": 50, "kv_usage": 0.5})  # a's queue is long
        assert wait_for(lambda: r.router.registry.overloaded == {"w1"}, 10)
        assert {generate(r.addr, f"s{i}")[1]["meta_info"]["worker"] for i in range(6)} == {b.name}
        b.post("/fake/load", {"num_waiting": 0, "kv_usage": 0.99})  # KV alone is not past 0
        b.post("/fake/load", {"num_waiting": 11})
        assert wait_for(lambda: len(r.router.registry.overloaded) == 2, 10)
        status, body = generate(r.addr, "shed")
        assert status == 503 and body["error"]["code"] == "overloaded"  # shed, not queued
    finally:
        for w in (a, b):
            w.post("/fake/load", {"num_waiting": 0, "kv_usage": 0.0})
    assert wait_for(lambda: not r.router.registry.overloaded, 10)
    assert generate(r.addr, "back")[0] == 200


def test_kv_usage_threshold(workers, make_router):  # noqa: F811
    a, b = workers[:2]
    r = make_router([a.url, b.url], policy="round_robin", health_check_interval_secs=0.1,
                    overload_kv_usage_threshold=0.9)  # fmt: skip
    try:
        b.post("/fake/load", {"num_waiting": 0, "kv_usage": 0.95})
        assert wait_for(lambda: r.router.registry.overloaded == {"w2"}, 10)
        assert {generate(r.addr, f"k{i}")[1]["meta_info"]["worker"] for i in range(4)} == {a.name}
    finally:
        b.post("/fake/load", {"num_waiting": 0, "kv_usage": 0.0})


def test_a_worker_reporting_garbage_stats_is_not_overloaded_and_probes_go_on(workers):  # noqa: F811
    a, b, c = workers[:3]
    health = HealthConfig(overload_waiting_threshold=10, overload_kv_usage_threshold=0.9)

    async def sweep() -> frozenset[str]:
        reg = WorkerRegistry(health, lambda _id: None)
        for w in (a, b, c):
            reg.add(w.url)
        await reg.check_all()  # raised on b's or c's stats, and the health loop died with it
        await reg.stop()
        return reg.overloaded

    try:
        a.post("/fake/load", {"num_waiting": 50, "kv_usage": 0.0})
        b.post("/fake/load", {"num_waiting": "many", "kv_usage": None})
        c.post("/fake/load", [1, 2])  # type: ignore[arg-type]
        assert asyncio.run(sweep()) == {"w1"}
    finally:
        for w in (a, b, c):
            w.post("/fake/load", {"num_waiting": 0, "kv_usage": 0.0})


def test_overload_polls_carry_the_worker_api_key(make_router):  # noqa: F811
    # /get_server_info is behind the workers' key: without it every poll was a 401, read as
    # "no report", and the thresholds silently did nothing.
    keyed = [FakeWorker(f"keyed{i}", "--api-key", "wk") for i in range(2)]
    auth = {"Authorization": "Bearer wk"}
    try:
        r = make_router([w.url for w in keyed], policy="round_robin", worker_api_key="wk",
                        health_check_interval_secs=0.1, overload_waiting_threshold=10)  # fmt: skip
        call("POST", f"127.0.0.1:{keyed[0].port}", "/fake/load", {"num_waiting": 50}, auth)
        assert wait_for(lambda: r.router.registry.overloaded == {"w1"}, 10)
        served = {generate(r.addr, f"p{i}")[1]["meta_info"]["worker"] for i in range(4)}
        assert served == {"keyed1"}
    finally:
        for w in keyed:
            w.kill()
