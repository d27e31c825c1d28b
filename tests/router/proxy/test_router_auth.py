"""Auth and tracing behind the router (issue 15): workers started with --api-key serve through it
(the client's Authorization forwarded, or --worker-api-key), worker management is for the admin
key or loopback clients only, X-Request-Id travels client -> router -> worker and back and is
logged on both sides, the worker's own response headers come back, and the server's /docs and
/openapi.json follow its --api-key. A real `radixserve serve --sim` is the worker where a real
server's behaviour is the point."""

from __future__ import annotations

import http.client
import json
import logging
import socket

import pytest

pytest.importorskip("httptools")

from server_harness import ServerProcess  # noqa: E402
from test_router_app import (  # noqa: E402
    FakeWorker,
    call,
    make_router,  # noqa: F401  (fixture)
    wait_for,
)


def request(addr: str, method: str, path: str, obj: object = None, headers: dict | None = None):
    """(status, headers, body bytes) of one request."""
    conn = http.client.HTTPConnection(addr, timeout=30)
    conn.request(method, path, None if obj is None else json.dumps(obj), headers or {})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


@pytest.fixture(scope="module")
def keyed_server():
    server = ServerProcess(["--sim", "tiny-cpu", "--api-key", "sekret", "--log-level", "info"])
    yield server
    server.stop()


def test_a_keyed_server_behind_the_router(keyed_server, make_router):  # noqa: F811
    body = {"prompt": "hello", "max_tokens": 2}
    key = {"Authorization": "Bearer sekret"}
    forwarding = make_router([keyed_server.url])
    assert request(forwarding.addr, "POST", "/v1/completions", body)[0] == 401  # the worker's
    assert request(forwarding.addr, "POST", "/v1/completions", body, key)[0] == 200
    assert request(forwarding.addr, "GET", "/v1/models", None, key)[0] == 200
    # Clients with the router's own key; the router holds the workers' key.
    own = make_router([keyed_server.url], api_key="client", worker_api_key="sekret")
    assert request(own.addr, "POST", "/v1/completions", body, key)[0] == 401  # not the router's
    client = {"Authorization": "Bearer client"}
    assert request(own.addr, "POST", "/v1/completions", body, client)[0] == 200
    status, models, _ = request(own.addr, "GET", "/v1/models", None, client)
    assert status == 200


def test_request_id_travels_and_is_logged_on_both_sides(keyed_server, make_router, caplog):  # noqa: F811
    r = make_router([keyed_server.url], worker_api_key="sekret")
    caplog.set_level(logging.DEBUG, logger="radixserve.router")
    body = {"prompt": "hello", "max_tokens": 2}
    status, headers, _ = request(r.addr, "POST", "/v1/completions", body,
                                 {"X-Request-Id": "trace-abc-123"})  # fmt: skip
    assert status == 200 and headers["x-request-id"] == "trace-abc-123"
    assert "trace-abc-123" in caplog.text  # the router's log
    assert wait_for(lambda: any("request trace-abc-123" in ln for ln in keyed_server.lines), 5)
    status, headers, _ = request(r.addr, "POST", "/v1/completions", body)
    made = headers["x-request-id"]  # none given: the router made one and the server saw it
    assert status == 200 and len(made) == 24
    assert wait_for(lambda: any(f"request {made}" in ln for ln in keyed_server.lines), 5)


def test_docs_and_openapi_follow_the_api_key(keyed_server):
    for path in ("/docs", "/openapi.json"):
        assert keyed_server.request("GET", path).status == 401
        ok = keyed_server.request("GET", path, headers={"Authorization": "Bearer sekret"})
        assert ok.status == 200
    schema = keyed_server.request(
        "GET", "/openapi.json", headers={"Authorization": "Bearer sekret"}
    )
    assert "/v1/completions" in schema.json()["paths"]


def test_worker_headers_come_back_and_fake_worker_sees_the_id(make_router):  # noqa: F811
    w = FakeWorker("hdr", "--api-key", "wk")
    try:
        r = make_router([w.url], worker_api_key="wk")
        status, headers, body = request(r.addr, "POST", "/generate", {"text": "x"},
                                        {"X-Request-Id": "id-1"})  # fmt: skip
    finally:
        w.kill()
    assert status == 200 and headers["x-fake-worker"] == "hdr"
    assert json.loads(body)["request_id"] == "id-1"


def non_loopback_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_management_needs_the_admin_key_or_a_loopback_client(make_router):  # noqa: F811
    addr = non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback address to connect from")
    r = make_router([], host="0.0.0.0", api_key="user")
    remote = f"{addr}:{r.port}"
    user = {"Authorization": "Bearer user"}
    status, body = call("POST", remote, "/workers", {"url": "http://10.0.0.1:1"}, user)
    assert status == 403 and body["error"]["type"] == "permission_error"  # an API key is not admin
    assert call("GET", remote, "/workers", None, user)[0] == 403
    assert call("GET", remote, "/health")[0] == 503  # probes stay open (no worker: 503)
    assert call("GET", r.addr, "/workers")[0] == 200  # loopback: the operator's own machine
    admin = make_router([], host="0.0.0.0", api_key="user", admin_api_key="root")
    remote = f"{addr}:{admin.port}"
    assert call("GET", remote, "/workers", None, {"Authorization": "Bearer root"})[0] == 200
    assert call("GET", admin.addr, "/workers")[0] == 401  # with an admin key, no exceptions
