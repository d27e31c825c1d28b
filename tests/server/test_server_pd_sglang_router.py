"""SGLang's own PD router (sglang-router 0.3.2, ``--pd-disaggregation``) in front of a radixserve
prefill engine and decode engine: it finds both through /server_info and /model_info, fills the
bootstrap fields, sends each request to both, and the client gets what one aggregated engine
answers, token for token; afterwards no slot is held on either side. Real processes throughout;
skipped, saying why, without the router's venv (RADIXSERVE_SGLANG_ROUTER_PYTHON; see .ci/run)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from tests.server.test_server_pd import PROMPTS, _check_clean, fleet  # noqa: F401 (fixture)

PYTHON = os.environ.get("RADIXSERVE_SGLANG_ROUTER_PYTHON")
if not PYTHON:
    pytest.skip(
        "sglang-router 0.3.2 is not installed: set RADIXSERVE_SGLANG_ROUTER_PYTHON to the python "
        "of a venv with `pip install sglang-router==0.3.2` (.ci/run builds one)",
        allow_module_level=True,
    )
pytest.importorskip("mooncake.engine")
pytest.importorskip("torch")

ROUTER_START_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class SglangRouter:
    """``python -m sglang_router.launch_router --pd-disaggregation`` on a free port."""

    def __init__(self, prefill: str, boot: int, decode: str) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        cmd = [PYTHON, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--prefill", prefill, str(boot), "--decode", decode, "--host", "127.0.0.1",
               "--port", self.url.rsplit(":", 1)[1], "--log-level", "warn"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ROUTER_START_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                out = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                raise RuntimeError(f"sglang-router did not start:\n{out[-3000:]}")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            status, body = _call(self.url + "/v1/models", timeout=2)
        except OSError:
            return False
        return status == 200 and bool(json.loads(body).get("data"))

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        status, raw = _call(self.url + path, body)
        if body.get("stream"):
            return status, [json.loads(b[len("data: ") :]) for b in raw.decode().split("\n\n")
                            if b.startswith("data: ") and b != "data: [DONE]"]  # fmt: skip
        return status, json.loads(raw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def routed(fleet):  # noqa: F811 (the fixture imported above)
    prefill, decode, agg, boot = fleet
    router = SglangRouter(prefill.url, boot, decode.url)
    yield router, prefill, decode, agg
    router.stop()


def test_generate_through_sglang_router_equals_an_aggregated_engine(routed):
    router, prefill, decode, agg = routed
    for new in (12, 1):  # one new token: the prefill engine's, which the decode engine returns
        sp = {"max_new_tokens": new, "temperature": 0}
        for prompt in PROMPTS:
            want = agg.post("/generate", {"text": prompt, "sampling_params": sp}).json()
            status, got = router.post("/generate", {"text": prompt, "sampling_params": sp})
            assert status == 200, got
            assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    _check_clean(prefill, decode)


def test_streamed_generate_through_sglang_router(routed):
    router, prefill, decode, agg = routed
    body = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    want = agg.post("/generate", body).json()
    status, chunks = router.post("/generate", {**body, "stream": True})
    assert status == 200 and chunks, chunks
    assert chunks[-1]["output_ids"] == want["output_ids"]
    _check_clean(prefill, decode)


def test_chat_and_completions_through_sglang_router(routed):
    router, prefill, decode, agg = routed
    chat = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 10,
            "temperature": 0}  # fmt: skip
    want = agg.post("/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    # no model named: sglang-router sends "unknown", which the engine takes as its own
    status, got = router.post("/v1/chat/completions", chat)
    assert status == 200, got
    assert got["choices"][0]["message"]["content"] == want
    status, chunks = router.post("/v1/chat/completions", {**chat, "stream": True})
    assert status == 200
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == want
    comp = {"model": agg.name, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    want = agg.post("/v1/completions", comp).json()["choices"][0]["text"]
    status, got = router.post("/v1/completions", comp)
    assert status == 200 and got["choices"][0]["text"] == want, got
    _check_clean(prefill, decode)
