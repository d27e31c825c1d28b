"""The life of a `radixserve serve` process: it refuses a port in use at once, ends running
streams cleanly when stopped, survives a dead engine with 503s, and leaves no process or IPC
socket behind however it ends (sim runner, except where a slow start is needed)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

from server_harness import ServerProcess, process_tree, wait_gone

SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _open_stream(server: ServerProcess, body: dict) -> http.client.HTTPResponse:
    """A /v1/completions stream whose first event has arrived."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    return resp


def test_a_dead_engine_is_a_503_and_a_killed_server_leaves_nothing():
    server = ServerProcess(["--sim", "tiny-cpu"])
    try:
        scheduler = server.get("/get_server_info").json()["engine"]["pid"]
        stream = _open_stream(server, {"prompt": "a long story", "max_tokens": 20_000,
                                       "stream": True, "ignore_eos": True})  # fmt: skip
        os.kill(scheduler, signal.SIGKILL)
        *_, error, done = stream.read().decode().strip().split("\n\n")  # ends, not hangs
        assert done == "data: [DONE]"
        assert json.loads(error[len("data: ") :])["error"]["code"] == "engine_unavailable"
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
        resp = _open_stream(server, {"prompt": "a long story", "max_tokens": 20_000,
                                     "stream": True, "ignore_eos": True})  # fmt: skip
        server.proc.send_signal(signal.SIGINT)
        *_, error, done = resp.read().decode().strip().split("\n\n")
        assert done == "data: [DONE]"
        assert json.loads(error[len("data: ") :])["error"]["code"] == "server_shutting_down"
        assert server.proc.wait(15) == 0
    finally:
        server.stop()  # no process or IPC socket left
    assert not server.errors(), server.output()


def test_stopped_while_the_engine_starts_it_leaves_nothing(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", str(tiny_model_dir),
           "--port", "0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # fmt: skip
    assert proc.stdout is not None
    assert "starting the engine" in proc.stdout.readline()
    deadline = time.monotonic() + 10
    while len(pids := process_tree(proc.pid)) < 4:  # + resource tracker, scheduler, detokenizer
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)  # spawned; the scheduler loads torch and the model for seconds more
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 1 and "stopped while starting the engine" in out, out
    assert "Traceback" not in out
    assert wait_gone(pids, 10) == [] and list(tmp_path.iterdir()) == []
