"""A prefill/decode pair when one side dies: a decode engine killed after it registered its
room leaves the prefill engine with an error for that request, within a bounded time, and no
slot held; the prefill engine keeps serving."""

from __future__ import annotations

import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.server.test_server_pd import PROMPTS, SMALL, START_S, _room, _settled
from tests.server_harness import ServerProcess

pytest.importorskip("mooncake.engine")
pytest.importorskip("torch")

WAIT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_decode_engine_killed_after_registering_leaves_the_prefill_side_clean():
    boot = _free_port()
    timeout = ["--disaggregation-waiting-timeout", str(WAIT_S)]
    with ThreadPoolExecutor(2) as pool:
        pf = pool.submit(ServerProcess, [*SMALL, "--disaggregation-mode", "prefill",
                                         "--disaggregation-bootstrap-port", str(boot), *timeout],
                         START_S)  # fmt: skip
        df = pool.submit(ServerProcess, [*SMALL, "--disaggregation-mode", "decode", *timeout],
                         START_S)  # fmt: skip
        prefill, decode = pf.result(), df.result()
    try:
        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": _room()}  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            pool.submit(lambda: _quiet(decode.post, "/generate", body))
            deadline = time.monotonic() + 30
            while prefill.get("/debug/check_integrity").json()["rooms"]["dests"] != 1:
                assert time.monotonic() < deadline, "the decode engine never registered"
                time.sleep(0.1)
            decode.stop(check=False, sig=signal.SIGKILL)
        t0 = time.monotonic()
        reply = prefill.post("/generate", body, timeout=120)
        assert reply.status == 502, reply.body
        assert "KV transfer" in reply.json()["error"]["message"]
        assert time.monotonic() - t0 < WAIT_S + 10
        _settled(prefill)
    finally:
        if decode.proc.poll() is None:  # failed before the kill
            decode.stop(check=False)
        prefill.stop()


def _quiet(fn, *args):
    try:
        return fn(*args, timeout=120)
    except OSError:  # the decode engine was killed under it
        return None
