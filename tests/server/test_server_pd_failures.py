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


def _pair(boot: int, wait_s: float, decode=None):
    timeout = ["--disaggregation-waiting-timeout", str(wait_s)]
    prefill_args = [*SMALL, "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(boot), *timeout]  # fmt: skip
    if decode is not None:
        return ServerProcess(prefill_args, START_S), decode
    with ThreadPoolExecutor(2) as pool:
        pf = pool.submit(ServerProcess, prefill_args, START_S)
        df = pool.submit(ServerProcess, [*SMALL, "--disaggregation-mode", "decode", *timeout],
                         START_S)  # fmt: skip
        return pf.result(), df.result()


def _both(prefill, decode, body):
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(_quiet, prefill.post, "/generate", body)
        return p, decode.post("/generate", body, timeout=120)


def test_a_prefill_engine_killed_mid_transfer_fails_the_decode_side_within_its_bound():
    import os

    wait_s, boot = 8.0, _free_port()
    prefill, decode = _pair(boot, wait_s)
    sp = {"max_new_tokens": 8, "temperature": 0}
    base = {"text": PROMPTS[1], "sampling_params": sp, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot}  # fmt: skip
    try:
        _, want = _both(prefill, decode, {**base, "bootstrap_room": _room()})
        assert want.status == 200, want.body
        # the prefill engine's scheduler, frozen with the request and the decode engine's
        # destination in hand, then killed: its pages never come
        pid = prefill.get("/get_server_info").json()["engine"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        body = {**base, "bootstrap_room": _room()}
        with ThreadPoolExecutor(1) as pool:
            pool.submit(_quiet, prefill.post, "/generate", body)
            t0 = time.monotonic()
            reply = decode.post("/generate", body, timeout=120)
            os.kill(pid, signal.SIGKILL)
            prefill.stop(check=False, sig=signal.SIGKILL)
        assert reply.status in (502, 504), reply.body
        assert "bootstrap_room" in reply.json()["error"]["message"]
        assert time.monotonic() - t0 < wait_s + 5
        # no slot leaks: held while a page could still land, then freed
        deadline = time.monotonic() + wait_s + 10
        while decode.get("/debug/check_integrity").json()["rooms"]["draining"]:
            assert time.monotonic() < deadline, "the decode engine never freed the room"
            time.sleep(0.2)
        _settled(decode)
        # a prefill engine started again on the same bootstrap port: the decode engine serves
        prefill, _ = _pair(boot, wait_s, decode)
        _, again = _both(prefill, decode, {**base, "bootstrap_room": _room()})
        assert again.status == 200 and again.json()["output_ids"] == want.json()["output_ids"]
        _settled(decode)
        _settled(prefill)
    finally:
        for s in (prefill, decode):
            if s.proc.poll() is None:
                s.stop(check=False)
