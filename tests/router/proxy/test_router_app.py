"""The router end to end over loopback HTTP: fake workers in subprocesses, the router in a thread.
Health checks and eviction are off unless a test turns them on, so runs are deterministic."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest

pytest.importorskip("httptools")

from fake_worker import spawn  # noqa: E402
from radixserve.config import with_flags  # noqa: E402
from radixserve.router.proxy.app import Router  # noqa: E402
from radixserve.router.proxy.config import RouterConfig  # noqa: E402
from radixserve.router.proxy.workers import ConnectionPool  # noqa: E402


class FakeWorker:
    """A fake worker process on a free port."""

    def __init__(self, name: str, *flags: str) -> None:
        self.proc, self.url = spawn("--name", name, *flags)
        self.name, self.port = name, int(self.url.rsplit(":", 1)[1])

    def post(self, path: str, obj: dict) -> dict:
        return call("POST", f"127.0.0.1:{self.port}", path, obj)[1]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class RouterThread:
    """A Router on its own event loop in a thread, listening on a free port."""

    def __init__(self, urls: list[str], **overrides: object) -> None:
        settings = {"port": 0, "health_check_interval_secs": 0, "eviction_interval_secs": 0}
        config = with_flags(RouterConfig, worker_urls=tuple(urls), **{**settings, **overrides})
        self.router, self.loop = Router(config), asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)
        self.addr = f"127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        self.port = self.loop.run_until_complete(self.router.start())
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.router.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def call(method: str, addr: str, path: str, obj: object = None, headers: dict | None = None):
    """(status, decoded JSON or text) of one request on a fresh connection."""
    conn = http.client.HTTPConnection(addr, timeout=20)
    body = obj if isinstance(obj, bytes) or obj is None else json.dumps(obj).encode()
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    is_json = resp.getheader("Content-Type", "").startswith("application/json")
    return resp.status, json.loads(data) if is_json else data.decode()


def generate(addr: str, text: str = "hello", **kw: object) -> tuple[int, dict]:
    return call("POST", addr, "/generate", {"text": text, **kw})


@pytest.fixture(scope="module")
def workers():
    ws = [FakeWorker(f"fw{i}") for i in range(3)]
    yield ws
    for w in ws:
        w.kill()


@pytest.fixture
def make_router():
    routers: list[RouterThread] = []

    def make(urls: list[str], **overrides: object) -> RouterThread:
        routers.append(RouterThread(urls, **overrides))
        return routers[-1]

    yield make
    for r in routers:
        r.stop()


def test_inference_endpoints_are_proxied(workers, make_router):
    r = make_router([w.url for w in workers])
    status, body = generate(r.addr, "The capital of France", sampling_params={"max_new_tokens": 3})
    assert status == 200 and body["text"] == " t0 t1 t2"
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    status, body = call("POST", r.addr, "/v1/chat/completions", chat)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    status, body = call("POST", r.addr, "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["text"] == " t0 t1"
    assert call("GET", r.addr, "/v1/models")[1]["data"][0]["id"] == "fake-model"


def test_shared_prefix_stays_on_one_worker(workers, make_router):
    r = make_router([w.url for w in workers], policy="cache_aware")
    prefix = "You are a helpful assistant. " * 20
    served = {
        generate(r.addr, prefix + f"question {i}")[1]["meta_info"]["worker"] for i in range(8)
    }
    assert len(served) == 1


def test_stream_arrives_as_sse_chunks_in_order(make_router):
    slow = FakeWorker("slow", "--token-delay-ms", "40")
    try:
        r = make_router([slow.url])
        conn = http.client.HTTPConnection(r.addr, timeout=10)
        body = {"prompt": "count", "max_tokens": 6, "stream": True}
        t0 = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
        arrivals = []
        while chunk := resp.read1(65536):
            arrivals.append((time.monotonic() - t0, chunk.decode()))
    finally:
        slow.kill()
    events = [e for _, c in arrivals for e in c.split("\n\n") if e]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert texts == [f" t{i}" for i in range(6)] and events[-1] == "data: [DONE]"
    # Passed through as generated, not buffered: the first token came long before the last.
    assert arrivals[-1][0] - arrivals[0][0] > 0.12


def test_worker_killed_mid_load_costs_no_request(make_router):
    fleet = [FakeWorker(f"k{i}") for i in range(3)]
    r = make_router([w.url for w in fleet], policy="round_robin", retry_backoff_ms=1)
    body = json.dumps({"text": "x" * 64}).encode()

    async def load(n: int, concurrency: int) -> list[int]:
        pool, statuses, todo = ConnectionPool(f"http://{r.addr}"), [], iter(range(n))

        async def user() -> None:
            for i in todo:
                if i == n // 3:
                    fleet[0].kill()
                statuses.append((await pool.request("POST", "/generate", body)).status)

        await asyncio.gather(*(user() for _ in range(concurrency)))
        pool.close()
        return statuses

    try:
        statuses = asyncio.run(load(900, 16))
    finally:
        for w in fleet:
            w.kill()
    assert statuses == [200] * 900
    loads = {w["id"]: w for w in call("GET", r.addr, "/workers")[1]["workers"]}
    assert loads["w1"]["circuit"] == "open" and loads["w1"]["errors"] >= 1


def test_add_and_remove_workers_at_run_time(workers, make_router):
    r = make_router([workers[0].url], policy="round_robin")
    status, added = call("POST", r.addr, "/workers", {"url": workers[1].url})
    assert status == 201 and added["url"] == workers[1].url
    assert call("POST", r.addr, "/workers", {"url": workers[1].url})[0] == 409
    status, body = call("POST", r.addr, "/workers", {"url": workers[2].url, "api_key": "k"})
    assert status == 400 and "api_key" in body["error"]["message"]  # refused, not ignored
    served = {generate(r.addr, f"p{i}")[1]["meta_info"]["worker"] for i in range(4)}
    assert served == {"fw0", "fw1"}
    assert call("DELETE", r.addr, f"/workers/{added['id']}")[0] == 200
    assert {generate(r.addr, f"q{i}")[1]["meta_info"]["worker"] for i in range(4)} == {"fw0"}
    assert call("POST", r.addr, f"/add_worker?url={workers[2].url}")[0] == 200
    assert call("GET", r.addr, "/list_workers")[1]["urls"] == [workers[0].url, workers[2].url]
    assert call("POST", r.addr, f"/remove_worker?url={workers[0].url}")[0] == 200
    assert call("POST", r.addr, "/remove_worker?url=http://nowhere:1")[0] == 404
    assert {generate(r.addr, f"s{i}")[1]["meta_info"]["worker"] for i in range(3)} == {"fw2"}


def test_api_key_and_admin_key(workers, make_router):
    r = make_router([workers[0].url], api_key="infer", admin_api_key="admin")
    status, body = generate(r.addr)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    user, admin = {"Authorization": "Bearer infer"}, {"Authorization": "Bearer admin"}
    assert call("POST", r.addr, "/generate", {"text": "a"}, user)[0] == 200
    assert call("GET", r.addr, "/workers", None, user)[0] == 401
    assert call("GET", r.addr, "/workers", None, admin)[0] == 200
    assert call("POST", r.addr, "/flush_cache", None, user)[0] == 401
    assert call("POST", r.addr, "/generate", {"text": "a"}, admin)[0] == 401  # separate keys
    assert call("GET", r.addr, "/health")[0] == 200  # probes need no key
    assert call("GET", r.addr, "/metrics")[0] == 200
    # Without an admin key, management is for loopback clients (tests/router/proxy/test_router_auth.py).


def test_payload_size_limit(workers, make_router):
    r = make_router([workers[0].url], max_payload_size=1000)
    assert generate(r.addr, "a" * 500)[0] == 200
    status, body = generate(r.addr, "a" * 2000)
    assert status == 413 and "too large" in body["error"]["message"]
    conn = http.client.HTTPConnection(r.addr, timeout=10)  # chunked: no length up front
    conn.request("POST", "/generate", iter([b'{"text": "', b"a" * 1500, b'"}']))
    assert conn.getresponse().status == 413


def test_retry_on_another_worker_then_clear_error(workers, make_router):
    r = make_router([w.url for w in workers[:2]], policy="round_robin", retry_backoff_ms=1)
    workers[0].post("/fake/fail", {"count": 1, "status": 503})
    assert all(generate(r.addr, f"r{i}")[0] == 200 for i in range(2))
    assert "radixserve_router_retries_total 1.0" in call("GET", r.addr, "/metrics")[1]
    for w in workers[:2]:
        w.post("/fake/fail", {"count": 10, "status": 503})
    status, body = generate(r.addr)
    assert status == 502 and body["error"]["code"] == "bad_gateway"
    assert "attempt" in body["error"]["message"]
    for w in workers[:2]:
        w.post("/fake/fail", {"count": 0})


def test_no_worker_is_503_and_bad_json_is_400(workers, make_router):
    empty = make_router([])
    status, body = generate(empty.addr)
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert call("GET", empty.addr, "/readiness")[0] == 503
    r = make_router([workers[0].url])
    status, body = call("POST", r.addr, "/generate", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]


def test_dead_worker_leaves_routing_and_comes_back(workers, make_router):
    dead_at_start = "http://127.0.0.1:9"  # nothing listens there; must not hold the router up
    t0 = time.monotonic()
    r = make_router(
        [workers[0].url, workers[1].url, dead_at_start],
        policy="round_robin",
        health_check_interval_secs=0.1,
        health_check_timeout_secs=0.5,
    )
    assert time.monotonic() - t0 < 2
    workers[1].post("/fake/health", {"ok": False})
    try:
        assert wait_for(lambda: healthy(r) == {"w1": True, "w2": False, "w3": False}, 3)
        assert {generate(r.addr, f"d{i}")[1]["meta_info"]["worker"] for i in range(4)} == {"fw0"}
    finally:
        workers[1].post("/fake/health", {"ok": True})
    assert wait_for(lambda: healthy(r)["w2"], 3)
    served = {generate(r.addr, f"e{i}")[1]["meta_info"]["worker"] for i in range(4)}
    assert served == {"fw0", "fw1"}


def healthy(r: RouterThread) -> dict[str, bool]:
    return {w["id"]: w["healthy"] for w in call("GET", r.addr, "/get_loads")[1]["workers"]}


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_flush_cache_and_metrics(workers, make_router):
    r = make_router([w.url for w in workers])
    for _ in range(2):
        generate(r.addr, "shared prefix " * 10)
    status, body = call("POST", r.addr, "/flush_cache")
    assert status == 200 and all(s == 200 for s in body["workers"].values())
    text = call("GET", r.addr, "/metrics")[1]
    assert 'radixserve_router_requests_total{worker="http' in text
    assert "radixserve_router_decision_seconds_count 2" in text
    assert "radixserve_router_expected_hit_rate" in text


def test_metrics_count_per_worker_and_expected_hits(workers, make_router):
    r = make_router([w.url for w in workers[:2]], retry_backoff_ms=1)
    prefix = "a long shared system prompt " * 20
    home = generate(r.addr, prefix + "0")[1]["meta_info"]["worker"]
    for i in range(1, 4):
        assert generate(r.addr, prefix + str(i))[1]["meta_info"]["worker"] == home
    holder = next(w for w in workers if w.name == home)
    holder.post("/fake/fail", {"count": 1, "status": 503})
    generate(r.addr, prefix + "4")  # fails on its home, served by the other worker
    m = dict(
        line.rsplit(" ", 1) for line in call("GET", r.addr, "/metrics")[1].splitlines()
        if not line.startswith("#")
    )  # fmt: skip
    other = next(w for w in workers[:2] if w is not holder)
    name = 'radixserve_router_{}{{worker="{}"}}'.format
    assert m[name("requests_total", holder.url)] == "5.0"
    assert m[name("errors_total", holder.url)] == "1.0"
    assert m[name("errors_total", other.url)] == "0.0"
    assert m["radixserve_router_retries_total"] == "1.0"
    assert float(m[name("tree_size_units", holder.url)]) >= len(prefix) // 8
    assert (
        float(m["radixserve_router_expected_hit_rate"]) > 0.5
    )  # 4 of 6 dispatches hit (the retry missed)
    assert m["radixserve_router_decision_seconds_count"] == "6.0"  # 5 requests, 1 retry
    assert call("POST", r.addr, "/flush_cache")[0] == 200
    text = call("GET", r.addr, "/metrics")[1]
    assert f'radixserve_router_tree_size_units{{worker="{holder.url}"}} 0.0' in text
