"""`radixserve serve --sim tiny-cpu`: the same server, scheduler and cache on the simulated runner
(no torch needed); the endpoints answer, an idle worker uses next to no CPU, a dead engine is a
503, and a killed server leaves no process behind."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from server_harness import ServerProcess, assert_error_body, cpu_seconds, wait_gone

SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
IDLE_CPU_S = 0.2  # CPU seconds the whole process tree may use in 2 s idle


@pytest.fixture(scope="module")
def sim_server():
    server = ServerProcess(["--sim", "tiny-cpu"])
    yield server
    server.stop()


def test_the_endpoints_answer(sim_server):
    for path in ("/health", "/health_generate", "/get_server_info", "/get_model_info",
                 "/v1/models", "/metrics"):  # fmt: skip
        assert sim_server.get(path).status == 200, path
    assert sim_server.get("/v1/models").json()["data"][0]["id"] == sim_server.name
    assert sim_server.get("/get_model_info").json()["model_path"] == "sim:tiny-cpu"
    text = sim_server.post("/generate", {"text": "hello there", "sampling_params": SAMPLING})
    assert text.json()["meta_info"]["completion_tokens"] == 6
    ids = sim_server.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": SAMPLING})
    assert len(ids.json()["output_ids"]) == 6
    stream = sim_server.post("/generate", {"text": "hello", "stream": True,
                             "sampling_params": SAMPLING})  # fmt: skip
    assert stream.events()[-1] == "[DONE]"
    chat = sim_server.post("/v1/chat/completions", {"max_tokens": 3, "messages":
                           [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert chat.json()["usage"]["completion_tokens"] == 3
    assert sim_server.post("/flush_cache", b"").json()["success"] is True
    assert_error_body(sim_server.post("/v1/completions", {"prompt": "a", "model": "x"}), 404)


def test_openai_client_streams_with_usage(sim_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=sim_server.url + "/v1", api_key="-", max_retries=0)
    kw = {"model": sim_server.name, "prompt": "the same prompt twice " * 4, "max_tokens": 4}
    client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))  # fmt: skip
    usage = chunks[-1].usage
    assert usage.completion_tokens == 4
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_an_idle_sim_server_uses_next_to_no_cpu(sim_server):
    sim_server.post("/generate", {"text": "warm up", "sampling_params": SAMPLING})
    sim_server.wait_idle()
    time.sleep(0.3)  # let the last answer's bookkeeping finish
    tree = sim_server.tree()
    assert len(tree) >= 3  # the server, the scheduler and the detokenizer at least
    before = cpu_seconds(tree)
    time.sleep(2.0)
    used = cpu_seconds(tree) - before
    assert used < IDLE_CPU_S, f"{used:.2f} CPU seconds in 2 s idle by {tree}"


def test_a_sim_server_loads_no_torch(sim_server):
    """Many simulated workers share one machine: none of their processes maps torch."""
    for pid in sim_server.tree():
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read(), pid


def test_a_dead_engine_is_a_503_and_a_killed_server_leaves_nothing():
    server = ServerProcess(["--sim", "tiny-cpu"])
    try:
        scheduler = server.get("/get_server_info").json()["engine"]["pid"]
        os.kill(scheduler, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.get("/health").status == 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for reply in (server.get("/health"), server.get("/health_generate"),
                      server.post("/generate", {"text": "a", "sampling_params": SAMPLING}),
                      server.post("/v1/completions", {"prompt": "a"})):  # fmt: skip
            assert reply.status == 503, reply
            assert reply.json()["error"]["code"] == "engine_unavailable"
        assert "radixserve_engine_up 0.0" in server.get("/metrics").body.decode()
        pids = server.tree()
        # the children watch their parent: a server killed outright still takes them along
        server.proc.kill()
        server.proc.wait(10)
        left = wait_gone(pids, 10)
    finally:
        server.stop(check=False)
    assert left == []


def test_a_port_in_use_fails_at_once_with_a_message():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "radixserve", "serve", "--sim", "tiny-cpu", "--port",
               str(port)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
    assert "starting the engine" not in done.stdout  # refused before any engine was started


def test_ctrl_c_ends_running_streams_with_an_error_event_and_exits_cleanly():
    """(SIGTERM does the same: the sim_server fixture stops that way.)"""
    server = ServerProcess(["--sim", "tiny-cpu", "--graceful-shutdown-secs", "0.5"])
    try:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "a long story",
                     "max_tokens": 20_000, "stream": True, "ignore_eos": True}))  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        server.proc.send_signal(signal.SIGINT)
        *_, error, done = resp.read().decode().strip().split("\n\n")
        conn.close()
        assert done == "data: [DONE]"
        assert json.loads(error[len("data: ") :])["error"]["code"] == "server_shutting_down"
        assert server.proc.wait(15) == 0
    finally:
        server.stop()  # no process or IPC socket left
    assert not server.errors(), server.output()
