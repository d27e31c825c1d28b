"""Worker registry, health checks, circuit breaker and the pooled HTTP client, against an
in-process fake worker on a random loopback port."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("httptools")

import fake_worker  # noqa: E402
from radixserve.router.proxy.config import HealthConfig  # noqa: E402
from radixserve.router.proxy.workers import (  # noqa: E402
    CircuitBreaker,
    ConnectionPool,
    UpstreamError,
    WorkerRegistry,
)

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port


def run_with_worker(test, **worker_kw):
    """Run `test(url, engine)` in a fresh loop next to an in-process fake worker."""

    async def main():
        server, engine, port = await fake_worker.start(**worker_kw)
        try:
            return await test(f"http://127.0.0.1:{port}", engine)
        finally:
            server.close()

    return asyncio.run(main())


def test_circuit_breaker_opens_half_opens_and_closes():
    cb = CircuitBreaker(failure_threshold=2, success_threshold=2, open_secs=5.0)
    cb.record(False, now=0.0)
    assert cb.allows(0.0)
    cb.record(False, now=1.0)
    assert not cb.allows(5.9) and cb.state == "open"
    assert cb.allows(6.0) and cb.state == "half_open"
    cb.record(False, now=6.0)  # a failed trial reopens at once
    assert not cb.allows(10.9) and cb.allows(11.0)
    cb.record(True, 11.0)
    assert cb.state == "half_open"
    cb.record(True, 11.1)
    assert cb.state == "closed"


def test_circuit_breaker_threshold_zero_never_opens():
    cb = CircuitBreaker(0, 1, 5.0)
    for t in range(100):
        cb.record(False, float(t))
    assert cb.allows(100.0)


def test_registry_add_get_remove_tells_the_policy():
    removed: list[str] = []
    reg = WorkerRegistry(HealthConfig(), removed.append)
    a, b = reg.add("127.0.0.1:8001/"), reg.add("http://127.0.0.1:8002")
    assert a.url == "http://127.0.0.1:8001" and (a.id, b.id) == ("w1", "w2")
    with pytest.raises(ValueError):
        reg.add("http://127.0.0.1:8001")
    with pytest.raises(ValueError):
        reg.add("https://secure:1")
    assert reg.get("w2") is b and reg.get("127.0.0.1:8002") is b and reg.get("w9") is None
    assert [v.healthy for v in reg.views(0.0, exclude=["w1"])] == [False, True]
    reg.remove(a)
    assert removed == ["w1"] and [w.id for w in reg.workers] == ["w2"]
    assert reg.add("http://127.0.0.1:8001").id == "w3"  # a new id: the policy starts it afresh


def test_health_checks_take_a_worker_out_and_bring_it_back():
    async def test(url, engine):
        removed: list[str] = []
        health = HealthConfig(
            health_check_timeout_secs=1.0, health_failure_threshold=2, health_success_threshold=2
        )
        reg = WorkerRegistry(health, removed.append)
        live, dead = reg.add(url), reg.add(DEAD)
        await reg.check_all()
        assert dead.healthy and removed == []  # one failure is below the threshold
        await reg.check_all()
        assert not dead.healthy and live.healthy and removed == ["w2"]
        assert [v.healthy for v in reg.views(0.0)] == [True, False]
        engine.healthy = False
        for _ in range(2):
            await reg.check_all()
        assert not live.healthy and reg.routable() == 0
        engine.healthy = True
        await reg.check_all()
        assert not live.healthy  # success threshold is 2
        await reg.check_all()
        assert live.healthy
        await reg.stop()

    run_with_worker(test)


def test_pool_keeps_connections_alive_and_buffers_json():
    async def test(url, engine):
        pool = ConnectionPool(url)
        for i in range(3):
            resp = await pool.request("POST", "/generate", json.dumps({"text": f"p{i}"}).encode())
            assert resp.status == 200 and json.loads(resp.body)["text"] == " t0 t1 t2 t3"
        assert len(pool._idle) == 1  # the same connection served all three
        assert (await pool.request("GET", "/nope")).status == 404
        pool.close()

    run_with_worker(test)


def test_pool_streams_chunks_to_the_sink_as_they_arrive():
    async def test(url, engine):
        pool, chunks, heads = ConnectionPool(url), [], []

        def on_head(status, headers, chunked):
            heads.append((status, chunked))
            return chunks.append

        body = json.dumps({"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 3}})
        resp = await pool.request("POST", "/generate", body.encode(), on_head)
        assert heads == [(200, True)] and resp.body == b""
        events = b"".join(chunks).decode().split("\n\n")
        assert [json.loads(e[6:])["text"] for e in events[:3]] == [" t0", " t0 t1", " t0 t1 t2"]
        assert events[3] == "data: [DONE]"
        pool.close()

    run_with_worker(test)


def test_pool_errors_are_upstream_errors():
    async def test(url, engine):
        with pytest.raises(UpstreamError):
            await ConnectionPool(DEAD).request("GET", "/health")
        slow = ConnectionPool(url)
        body = json.dumps({"text": "x", "stream": True, "max_tokens": 50}).encode()
        with pytest.raises(UpstreamError, match="timed out"):
            await slow.request("POST", "/generate", body, lambda *a: lambda b: None, 0.1)
        assert (await slow.request("GET", "/health")).status == 200  # a fresh connection
        slow.close()

    run_with_worker(test, token_delay_ms=20)


def test_pool_rejects_non_http_urls():
    with pytest.raises(ValueError):
        ConnectionPool("https://example.com")
