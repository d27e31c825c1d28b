"""The router's own errors on /v1/messages come in Anthropic's shape, as the official `anthropic`
client reads them, through a real `radixserve route` in front of real `serve --sim` workers: a
wrong key (sent as x-api-key, as the client sends it; the right one passes), no worker, a body
that is not JSON, a body over the size limit, workers that fail, a worker killed mid-stream (the
stream ends with Anthropic's error event and no OpenAI [DONE]); and in PD mode the same. The
OpenAI routes keep OpenAI's shape."""

from __future__ import annotations

import http.client
import json
import socket
import sys

import pytest

pytest.importorskip("httptools")
anthropic = pytest.importorskip("anthropic")

from test_router_fleet import Proc, RouterProc, WorkerProc  # noqa: E402

KEY = "sk-router-key"
SLOW = "llama3-70b-tp4-a100"  # ~25 ms a token in real time: a long stream can be cut mid-way
ASK = [{"role": "user", "content": "Tell me a long story."}]


def launch(*flags: str, preset: str = SLOW) -> WorkerProc:
    worker = WorkerProc([sys.executable, "-m", "radixserve", "serve", "--sim", preset,
                         "--max-total-tokens", "8192", "--port", "0", "--log-level", "warning",
                         *flags])  # fmt: skip
    worker.url = worker.wait_line(r"serving \S+ on (http://\S+)").group(1)
    worker.model = "sim-" + preset  # type: ignore[attr-defined]
    return worker


def dead_url() -> str:
    """A loopback URL nothing listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def client(router: Proc, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://{router.addr}", api_key=key, max_retries=0)


def raw(router: Proc, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(router.addr, timeout=60)
    try:
        conn.request("POST", path, body, headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def anthropic_error(body: object, kind: str) -> str:
    """The message of an Anthropic error object of type `kind` (and nothing of OpenAI's)."""
    assert isinstance(body, dict) and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body["error"]["message"]


@pytest.fixture(scope="module")
def worker():
    w = launch("--api-key", KEY)  # the same key: the router forwards the client's
    yield w
    w.stop()


@pytest.fixture(scope="module")
def keyed(worker):
    """A router with a client key and a small body limit in front of the worker."""
    r = RouterProc([worker.url], "--api-key", KEY, "--max-payload-size", "4096")
    yield r
    r.stop()


def test_a_wrong_key_is_an_authentication_error_and_the_right_one_passes(keyed, worker):
    m = client(keyed).messages.create(model=worker.model, max_tokens=3, messages=ASK)
    assert m.usage.output_tokens == 3  # x-api-key is the router's key, and the worker's after it
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(keyed, "sk-wrong").messages.create(model=worker.model, max_tokens=3, messages=ASK)
    assert anthropic_error(e.value.body, "authentication_error") == "missing or wrong API key"


def test_a_body_that_is_not_json_is_a_bad_request(keyed):
    with pytest.raises(anthropic.BadRequestError) as e:  # JSON, but not an object
        client(keyed).post("/v1/messages", cast_to=object, body=["not", "a", "message"])
    assert "not a JSON object" in anthropic_error(e.value.body, "invalid_request_error")
    status, body = raw(keyed, "/v1/messages", b'{"model": ', {"x-api-key": KEY})
    assert status == 400
    assert "not a JSON object" in anthropic_error(json.loads(body), "invalid_request_error")
    # OpenAI's routes keep OpenAI's shape
    status, body = raw(keyed, "/v1/chat/completions", b"{", {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and json.loads(body)["error"]["code"] == "bad_request"


def test_a_body_over_the_limit_is_request_too_large(keyed, worker):
    big = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(anthropic.APIStatusError) as e:
        client(keyed).messages.create(model=worker.model, max_tokens=3, messages=big)
    assert e.value.status_code == 413
    assert "request body too large" in anthropic_error(e.value.body, "request_too_large")


def test_no_worker_is_the_clients_503_and_failing_workers_an_api_error():
    empty = RouterProc([])
    dead = RouterProc([dead_url()], "--retry-backoff-ms", "1")
    try:
        with pytest.raises(anthropic.InternalServerError) as e:
            client(empty).messages.create(model="m", max_tokens=3, messages=ASK)
        assert e.value.status_code == 503  # the SDK's ServiceUnavailableError where it has one
        message = anthropic_error(e.value.body, "overloaded_error")
        assert message == "no healthy worker available"
        with pytest.raises(anthropic.InternalServerError) as e:
            client(dead).messages.create(model="m", max_tokens=3, messages=ASK)
        assert e.value.status_code == 502
        assert "3 attempt(s)" in anthropic_error(e.value.body, "api_error")
    finally:
        empty.stop()
        dead.stop()


@pytest.fixture
def doomed():
    """A worker to kill mid-stream and a router in front of it alone."""
    w = launch()
    r = RouterProc([w.url])
    yield w, r
    r.stop()
    w.stop()


def test_a_worker_killed_mid_stream_ends_the_sdks_stream_with_an_error_event(doomed):
    w, r = doomed
    stream = client(r).messages.create(model=w.model, max_tokens=2000, messages=ASK, stream=True)
    events = iter(stream)
    assert next(events).type == "message_start"
    assert [next(events).type for _ in range(3)][-1] == "content_block_delta"
    w.kill()
    with pytest.raises(anthropic.APIStatusError) as e:
        for _ in events:
            pass
    assert anthropic_error(e.value.body, "api_error").startswith("worker failed mid-stream")


def test_a_stream_cut_mid_way_has_no_openai_done(doomed):
    w, r = doomed
    body = {"model": w.model, "max_tokens": 2000, "messages": ASK, "stream": True}
    conn = http.client.HTTPConnection(r.addr, timeout=60)
    conn.request("POST", "/v1/messages", json.dumps(body))
    resp = conn.getresponse()
    got = resp.read1(65536)
    w.kill()
    got += resp.read()  # a properly ended chunked body: no IncompleteRead
    conn.close()
    blocks = [b for b in got.decode().split("\n\n") if b.strip()]
    assert blocks[0].startswith("event: message_start\n")
    name, data = blocks[-1].split("\n")
    assert name == "event: error" and "[DONE]" not in got.decode()
    assert "mid-stream" in anthropic_error(json.loads(data.removeprefix("data: ")), "api_error")


class PdRouter(Proc):
    def __init__(self, *flags: str) -> None:
        super().__init__([sys.executable, "-m", "radixserve", "route", "--port", "0",
                          "--log-level", "info", "--pd-disaggregation", *flags])  # fmt: skip
        self.addr = self.wait_line(r"routing on http://(\S+) to").group(1)


def test_a_pd_routers_own_errors_on_messages_are_anthropics():
    r = PdRouter("--prefill", dead_url(), "--decode", dead_url(), "--api-key", KEY,
                 "--retry-backoff-ms", "1")  # fmt: skip
    try:
        with pytest.raises(anthropic.AuthenticationError):
            client(r, "sk-wrong").messages.create(model="m", max_tokens=3, messages=ASK)
        with pytest.raises(anthropic.BadRequestError) as e:
            client(r).post("/v1/messages", cast_to=object, body=[1])
        anthropic_error(e.value.body, "invalid_request_error")
        with pytest.raises(anthropic.BadRequestError) as e:  # the router fills these itself
            client(r).messages.create(model="m", max_tokens=3, messages=ASK,
                                      extra_body={"bootstrap_room": 7})  # fmt: skip
        message = anthropic_error(e.value.body, "invalid_request_error")
        assert message.startswith("bootstrap_room: a PD router fills")
        with pytest.raises(anthropic.InternalServerError) as e:  # both sides unreachable
            client(r).messages.create(model="m", max_tokens=3, messages=ASK)
        assert e.value.status_code == 502 and anthropic_error(e.value.body, "api_error")
    finally:
        r.stop()
