"""Prefill and decode on two real engines (SmolLM2, KV pages over Mooncake's transfer engine,
TCP): each request sent to both at once with a fresh room, as a PD router sends it. The decode
side's answer must be the aggregated engine's, token for token; afterwards no slot is held."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from tests.server_harness import ServerProcess

pytest.importorskip("mooncake.engine")
pytest.importorskip("torch")

SMALL = ["--max-total-tokens", "2048", "--num-threads", "1"]
START_S = 400.0
WAIT_S = 20.0  # --disaggregation-waiting-timeout of both engines (room for a busy machine)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet():
    boot = _free_port()
    timeout = ["--disaggregation-waiting-timeout", str(WAIT_S)]
    with ThreadPoolExecutor(3) as pool:  # three model loads at once: slow on a busy machine
        futs = [
            pool.submit(ServerProcess, [*SMALL, "--disaggregation-mode", "prefill",
                                        "--disaggregation-bootstrap-port", str(boot), *timeout],
                        START_S),
            pool.submit(ServerProcess, [*SMALL, "--disaggregation-mode", "decode", *timeout],
                        START_S),
            pool.submit(ServerProcess, SMALL, START_S),
        ]  # fmt: skip
        servers = [f.result() for f in futs]
    yield (*servers, boot)
    for s in servers:
        s.stop()


def _room() -> int:
    return random.randint(0, 2**63 - 1)


def _both(prefill, decode, path: str, body: dict[str, Any], boot: int) -> tuple[Any, Any]:
    """Send ``body`` with a fresh room to both engines at once; their replies."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot,
            "bootstrap_room": _room()}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.post, path, body, timeout=120)
        d = pool.submit(decode.post, path, body, timeout=120)
        return p.result(), d.result()


def _settled(server) -> dict[str, Any]:
    """The engine's integrity report once nothing runs: every slot free or evictable."""
    deadline = time.monotonic() + 15
    while True:
        report = server.get("/debug/check_integrity").json()
        # rooms too: a peer's message (a cancel, say) may still be on its way to be handled
        idle = report["running"] == report["waiting"] == report["receiving"] == 0
        if idle and not any(report["rooms"].values()):
            break
        assert time.monotonic() < deadline, report
        time.sleep(0.1)
    assert report["ok"], report
    assert report["free"] + report["evictable"] == report["total"], report
    assert not any(report["rooms"].values()), report
    return report


def _check_clean(*servers) -> None:
    for s in servers:
        _settled(s)


def test_generate_is_token_identical_to_an_aggregated_engine(fleet):
    prefill, decode, agg, boot = fleet
    sp = {"max_new_tokens": 12, "temperature": 0}
    for prompt in PROMPTS:
        want = agg.post("/generate", {"text": prompt, "sampling_params": sp}).json()
        p, d = _both(prefill, decode, "/generate", {"text": prompt, "sampling_params": sp}, boot)
        assert p.status == 200 and d.status == 200, (p.body, d.body)
        assert d.json()["output_ids"] == want["output_ids"], prompt
        assert d.json()["text"] == want["text"]
        # the prefill engine answers with the first token, which it sampled and sent
        assert p.json()["output_ids"] == want["output_ids"][:1]
    _check_clean(prefill, decode)


def test_a_cached_prefix_is_not_recomputed_on_the_prefill_engine(fleet):
    prefill, decode, agg, boot = fleet
    sp = {"max_new_tokens": 6, "temperature": 0}
    stem = "Here is a long shared system prompt about the weather in spring. " * 3
    for tail in ("Question one?", "Question two?"):
        text = stem + tail
        want = agg.post("/generate", {"text": text, "sampling_params": sp}).json()
        p, d = _both(prefill, decode, "/generate", {"text": text, "sampling_params": sp}, boot)
        assert d.json()["output_ids"] == want["output_ids"]
    assert p.json()["meta_info"]["cached_tokens"] > 20  # the second prompt reused the stem
    _check_clean(prefill, decode)


def test_streamed_completions_and_chat_match_the_aggregated_engine(fleet):
    prefill, decode, agg, boot = fleet
    cases = [
        ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}],
                                  "max_tokens": 10, "temperature": 0}),
    ]  # fmt: skip
    for path, body in cases:
        want = agg.post(path, body).json()["choices"][0]
        p, d = _both(prefill, decode, path, {**body, "stream": True}, boot)
        assert p.status == 200 and d.status == 200, (p.body, d.body)
        chunks = [json.loads(e) for e in d.events() if e != "[DONE]"]
        key = "text" if path.endswith("completions") and "prompt" in body else "content"
        got = "".join(
            c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get(key) or ""
            for c in chunks
            if c["choices"]
        )
        expected = want["text"] if "prompt" in body else want["message"]["content"]
        assert got == expected, path
    _check_clean(prefill, decode)


def test_a_room_reused_while_in_flight_is_refused(fleet):
    prefill, decode, _, boot = fleet
    room = _room()
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": room}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(prefill.post, "/generate", body, timeout=60)  # no decode: it waits
        time.sleep(1.0)
        again = prefill.post("/generate", body)
        assert again.status == 400, again.body
        assert again.json()["error"]["param"] == "bootstrap_room"
        assert "in flight" in again.json()["error"]["message"]
        # the first one, whose decode engine never registered, ends within the bound
        t0 = time.monotonic()
        reply = first.result()
    assert reply.status == 504, reply.body
    assert "no decode engine registered" in reply.json()["error"]["message"]
    assert time.monotonic() - t0 < WAIT_S + 5
    _check_clean(prefill, decode)


def test_a_decode_that_never_gets_its_pages_answers_an_error_within_its_bound(fleet):
    prefill, decode, _, boot = fleet
    body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": _room()}  # fmt: skip
    t0 = time.monotonic()
    reply = decode.post("/generate", body, timeout=60)  # the prefill side never gets it
    assert reply.status in (502, 504), reply.body
    assert "bootstrap_room" in reply.json()["error"]["message"]
    assert time.monotonic() - t0 < WAIT_S + 5
    _check_clean(prefill, decode)


def test_pages_for_an_unknown_room_are_refused(fleet):
    import zmq

    from radixserve.engine.messages import KVDone

    prefill, decode, agg, boot = fleet
    info = decode.get("/get_server_info").json()["engine"]["disaggregation"]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"tcp://{info['rank_ip']}:{info['rank_port']}")
    sock.send_pyobj(KVDone(_room(), 42))  # no request waits on this room
    sock.close(linger=1000)
    # the decode engine is unharmed: still exact, nothing held
    sp = {"max_new_tokens": 6, "temperature": 0}
    want = agg.post("/generate", {"text": PROMPTS[1], "sampling_params": sp}).json()
    _, d = _both(prefill, decode, "/generate", {"text": PROMPTS[1], "sampling_params": sp}, boot)
    assert d.json()["output_ids"] == want["output_ids"]
    _check_clean(prefill, decode)


def test_roles_and_fields_must_agree(fleet):
    prefill, decode, agg, boot = fleet
    plain = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
    for server in (prefill, decode):
        reply = server.post("/generate", plain)
        assert reply.status == 400 and reply.json()["error"]["param"] == "bootstrap_room"
    reply = agg.post("/generate", {**plain, "bootstrap_room": 7})
    assert reply.status == 400 and "--disaggregation-mode" in reply.json()["error"]["message"]
    reply = decode.post("/generate", {**plain, "bootstrap_room": 7, "bootstrap_port": boot})
    assert reply.status == 400 and reply.json()["error"]["param"] == "bootstrap_host"
    _check_clean(prefill, decode)


def test_a_bootstrap_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "radixserve", "serve", "--port", "0",
               "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--disaggregation-bootstrap-port" in lines[0], done.stderr


def test_a_client_that_leaves_mid_stream_frees_both_sides(fleet):
    import http.client

    prefill, decode, _, boot = fleet
    body = {"text": PROMPTS[1], "stream": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": _room()}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        p = pool.submit(prefill.post, "/generate", body, timeout=60)
        conn = http.client.HTTPConnection(decode.host, decode.port, timeout=60)
        conn.request("POST", "/generate", json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # generating: now leave
        conn.close()
        assert p.result().status == 200
    _check_clean(prefill, decode)


def test_output_logprobs_match_the_aggregated_engine(fleet):
    prefill, decode, agg, boot = fleet
    body = {"text": PROMPTS[2], "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}  # fmt: skip
    want = agg.post("/generate", body).json()["meta_info"]
    _, d = _both(prefill, decode, "/generate", body, boot)
    got = d.json()["meta_info"]
    # the first token's logprob was computed by the prefill engine and sent with it
    assert [t[1] for t in got["output_token_logprobs"]] == [
        t[1] for t in want["output_token_logprobs"]
    ]
    for g, w in zip(got["output_token_logprobs"], want["output_token_logprobs"]):
        assert abs(g[0] - w[0]) < 1e-4
    for g, w in zip(got["output_top_logprobs"], want["output_top_logprobs"]):
        assert [t[1] for t in g] == [t[1] for t in w]
        assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(g, w))
    _check_clean(prefill, decode)


def test_input_logprobs_merged_as_a_pd_router_merges_them(fleet):
    prefill, decode, agg, boot = fleet
    body = {"text": PROMPTS[0], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}  # fmt: skip
    want = agg.post("/generate", body).json()["meta_info"]["input_token_logprobs"]
    p, d = _both(prefill, decode, "/generate", body, boot)
    merged = (p.json()["meta_info"]["input_token_logprobs"]
              + d.json()["meta_info"]["input_token_logprobs"])  # fmt: skip
    assert [t[1] for t in merged] == [t[1] for t in want]
    for g, w in zip(merged, want):
        assert (g[0] is None) == (w[0] is None)
        assert g[0] is None or abs(g[0] - w[0]) < 1e-4
    _check_clean(prefill, decode)


def test_one_new_token_is_the_prefill_engines_returned_by_the_decode_engine(fleet):
    prefill, decode, agg, boot = fleet
    for path, body in [("/generate", {"text": PROMPTS[0], "sampling_params": {
                            "max_new_tokens": 1, "temperature": 0}}),
                       ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 1,
                                            "temperature": 0})]:  # fmt: skip
        want = agg.post(path, body).json()
        p, d = _both(prefill, decode, path, body, boot)
        assert p.status == 200 and d.status == 200, (p.body, d.body)
        if path == "/generate":
            assert d.json()["output_ids"] == want["output_ids"] == p.json()["output_ids"]
        else:
            assert d.json()["choices"][0]["text"] == want["choices"][0]["text"]
    _check_clean(prefill, decode)


def _rooms(server) -> dict[str, Any]:
    return server.get("/debug/check_integrity").json()


def _until(fn, what: str, limit: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    while not (got := fn()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return got


def test_a_cancel_on_decode_holds_its_slots_until_no_page_can_land(fleet):
    import os
    import signal

    prefill, decode, _, boot = fleet
    rid = f"drain-{_room()}"
    body = {"text": PROMPTS[1], "rid": rid, "sampling_params": {"max_new_tokens": 20},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": _room()}  # fmt: skip
    # the prefill engine's scheduler, frozen: whatever it has been sent, it may still write
    pid = prefill.get("/get_server_info").json()["engine"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(decode.post, "/generate", body, timeout=60)
            _until(lambda: _rooms(decode)["rooms"]["waiting"] == 1, "never registered")
            held = _rooms(decode)["free"]
            assert decode.post("/abort_request", {"rid": rid}).status == 200
            assert b"abort" in first.result().body  # the client hears at once
        report = _until(lambda: (r := _rooms(decode))["rooms"]["draining"] == 1 and r, "drain")
        # its slots stay reserved: a transfer already begun cannot land in reused slots
        assert report["free"] == held and report["receiving"] == 1 and report["ok"], report
        time.sleep(1.0)
        assert _rooms(decode)["free"] == held
    finally:
        os.kill(pid, signal.SIGCONT)
    # the prefill engine answers the cancel: no page is on its way, the slots are freed
    _check_clean(prefill, decode)


def test_the_decode_engine_reuses_the_prompt_pages_it_holds(fleet):
    prefill, decode, agg, boot = fleet
    sp = {"max_new_tokens": 8, "temperature": 0}
    turn = "A long shared system prompt about the history of sailing ships and their crews. " * 4
    sent = []
    for text in (turn + "First question?", turn + "Second question?"):
        before = _rooms(decode)["transfer"]
        want = agg.post("/generate", {"text": text, "sampling_params": sp}).json()
        _, d = _both(prefill, decode, "/generate", {"text": text, "sampling_params": sp}, boot)
        assert d.status == 200 and d.json()["output_ids"] == want["output_ids"], text
        after = _rooms(decode)["transfer"]
        sent.append({k: after[k] - before[k] for k in after})
    prompt = sum(sent[1].values())
    # the second prompt's shared part was in the decode engine's tree: only its tail was sent
    assert sent[0]["prompt_tokens_sent"] > 50
    assert sent[1]["prompt_tokens_reused"] > 50 and sent[1]["prompt_tokens_sent"] < prompt // 4
    print(f"decode engine, prompt tokens sent/reused: first {sent[0]}, second {sent[1]}")
    _check_clean(prefill, decode)
