"""`radixserve route --pd-disaggregation` in front of a real prefill engine and a real decode
engine (SmolLM2, KV pages over Mooncake's transfer engine, TCP): what a client gets through it
on /generate, /v1/completions, /v1/chat/completions and /v1/messages, whole and streamed, is
what one aggregated engine answers; /workers shows the roles; workers come and go with a role;
and after each test no KV slot is held on either engine."""

from __future__ import annotations

import http.client
import json
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("mooncake.engine")
pytest.importorskip("torch")
pytest.importorskip("httptools")

from tests.router.proxy.test_router_fleet import Proc  # noqa: E402
from tests.server.test_server_pd import START_S, _settled  # noqa: E402
from tests.server_harness import ServerProcess  # noqa: E402

ENGINE = ["--max-total-tokens", "4096", "--num-threads", "1",
          "--disaggregation-waiting-timeout", "20"]  # fmt: skip
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three primes:"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PdRouter(Proc):
    """`radixserve route --pd-disaggregation ...` on a free port."""

    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "radixserve", "route", "--port", "0", "--log-level", "info",
               "--pd-disaggregation", *flags]  # fmt: skip
        super().__init__(cmd)
        self.addr = self.wait_line(r"routing on http://(\S+) to").group(1)

    def call(
        self, method: str, path: str, obj: Any = None, timeout: float = 120
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.addr, timeout=timeout)
        try:
            conn.request(method, path, None if obj is None else json.dumps(obj))
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, obj: Any = None) -> tuple[int, Any]:
        status, body = self.call(method, path, obj)
        return status, json.loads(body)


def start_engines(*roles: str, boots: list[int]) -> list[ServerProcess]:
    """One engine per role (prefill ones on the bootstrap ports in ``boots``), loaded at once."""
    args, ports = [], iter(boots)
    for role in roles:
        extra = [] if role == "neutral" else ["--disaggregation-mode", role]
        if role == "prefill":
            extra += ["--disaggregation-bootstrap-port", str(next(ports))]
        args.append([*(ENGINE if role != "neutral" else ENGINE[:4]), *extra])
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(lambda a: ServerProcess(a, START_S), args))


@pytest.fixture(scope="module")
def pd():
    boot = free_port()
    prefill, decode, agg = start_engines("prefill", "decode", "neutral", boots=[boot])
    router = PdRouter("--prefill", prefill.url, str(boot), "--decode", decode.url)
    yield prefill, decode, agg, router
    router.stop()
    for s in (prefill, decode, agg):
        s.stop()


def events(body: bytes) -> list[Any]:
    out = []
    for block in body.decode().split("\n\n"):  # Anthropic's blocks open with an event: line
        data = [ln[len("data: ") :] for ln in block.splitlines() if ln.startswith("data: ")]
        if data and data[0] != "[DONE]":
            out.append(json.loads(data[0]))
    return out


def streamed_text(path: str, body: bytes) -> str:
    got = []
    for e in events(body):
        if path == "/v1/messages":
            got.append((e.get("delta") or {}).get("text") or "")
        elif e.get("choices"):
            c = e["choices"][0]
            got.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(got)


def whole_text(path: str, obj: Any) -> str:
    if path == "/v1/messages":
        return "".join(b.get("text", "") for b in obj["content"])
    c = obj["choices"][0]
    return c["text"] if path == "/v1/completions" else c["message"]["content"]


def test_workers_show_their_roles(pd):
    prefill, decode, _, router = pd
    status, listed = router.json("GET", "/workers")
    assert status == 200
    roles = {w["url"]: (w["role"], w.get("bootstrap_port")) for w in listed["workers"]}
    boot = int(router.proc.args[router.proc.args.index(prefill.url) + 1])
    assert roles == {prefill.url: ("prefill", boot), decode.url: ("decode", None)}


def test_generate_is_what_an_aggregated_engine_answers(pd):
    prefill, decode, agg, router = pd
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        want = agg.post("/generate", body).json()
        status, got = router.json("POST", "/generate", body)
        assert status == 200, got
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    _settled(prefill), _settled(decode)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 12, "temperature": 0}),
        ("/v1/messages",
         {"messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 12, "temperature": 0}),
    ],
)  # fmt: skip
def test_openai_and_anthropic_routes_whole_and_streamed(pd, path, body):
    prefill, decode, agg, router = pd
    model = agg.get("/v1/models").json()["data"][0]["id"]
    body = {**body, "model": model}
    want = whole_text(path, agg.post(path, body).json())
    assert want
    status, got = router.json("POST", path, body)
    assert status == 200, got
    assert whole_text(path, got) == want
    status, raw = router.call("POST", path, {**body, "stream": True})
    assert status == 200, raw
    assert streamed_text(path, raw) == want
    _settled(prefill), _settled(decode)


def test_prompt_logprobs_come_from_the_prefill_side(pd):
    prefill, decode, agg, router = pd
    body = {"text": PROMPTS[0], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}  # fmt: skip
    want = agg.post("/generate", body).json()["meta_info"]
    status, whole = router.json("POST", "/generate", body)
    assert status == 200, whole
    status, raw = router.call("POST", "/generate", {**body, "stream": True})
    assert status == 200
    for meta in (whole["meta_info"], events(raw)[-1]["meta_info"]):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got, exp = meta[key], want[key]
            assert [t[1] for t in got] == [t[1] for t in exp], key
            for g, w in zip(got, exp):
                assert (g[0] is None) == (w[0] is None)
                assert g[0] is None or abs(g[0] - w[0]) < 1e-4
    _settled(prefill), _settled(decode)


def test_what_the_router_cannot_honour_is_refused(pd):
    prefill, decode, _, router = pd
    status, err = router.json("POST", "/generate", {"text": "x", "bootstrap_room": 5})
    assert status == 400 and err["error"]["param"] == "bootstrap_room"
    body = {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 2}
    status, err = router.json("POST", "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == "echo"
    # the engines' own refusals reach the client as they said them
    status, err = router.json(
        "POST", "/generate", {"text": "x", "sampling_params": {"temperature": -1}}
    )
    assert status == 400, err
    _settled(prefill), _settled(decode)


def test_workers_come_and_go_with_a_role(pd):
    prefill, decode, _, router = pd
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    status, listed = router.json("GET", "/workers")
    did = next(w["id"] for w in listed["workers"] if w["role"] == "decode")
    assert router.json("DELETE", f"/workers/{did}")[0] == 200
    status, err = router.json("POST", "/generate", body)
    assert status == 503 and "no healthy decode worker" in err["error"]["message"]
    status, err = router.json("POST", "/workers", {"url": decode.url})
    assert status == 400 and "role" in err["error"]["message"]
    status, err = router.json("POST", "/workers", {"url": decode.url, "role": "decode",
                                                   "bootstrap_port": 1234})  # fmt: skip
    assert status == 400 and "bootstrap_port" in err["error"]["message"]
    status, added = router.json("POST", "/workers", {"url": decode.url, "role": "decode"})
    assert status == 201 and added["role"] == "decode", added
    status, got = router.json("POST", "/generate", body)
    assert status == 200 and got["output_ids"], got
    _settled(prefill), _settled(decode)
