"""Changing the scheduler's settings of a running server (SGLang's /set_internal_state and
/update_scheduler_settings): guarded by the admin key, applied while requests run with none
lost, shown by /get_server_info, and refused whole when a setting cannot change."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_harness import TINY_SERVER_ARGS, ServerProcess, assert_error_body

ADMIN, USER = "admin-secret", "user-secret"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = ServerProcess(["--model", str(tiny_model_dir), *TINY_SERVER_ARGS,
                            "--api-key", USER, "--admin-api-key", ADMIN])  # fmt: skip
    yield server
    server.stop()


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def _update(server, body: dict, key: str = ADMIN, path: str = "/update_scheduler_settings"):
    return server.request("POST", path, body, headers=_as(key))


def _scheduler_info(server) -> dict:
    return server.request("GET", "/get_server_info", headers=_as(USER)).json()["scheduler"]


def _generate(server, i: int) -> dict:
    body = {"text": f"request {i} shares nothing", "sampling_params": {"max_new_tokens": 40,
            "temperature": 0, "ignore_eos": True}}  # fmt: skip
    reply = server.request("POST", "/generate", body, headers=_as(USER))
    assert reply.status == 200, reply.body
    return reply.json()


def test_only_the_admin_key_may_change_settings(server):
    for key in ("", USER):
        assert_error_body(_update(server, {"max_wait_ms": 10.0}, key=key), 401)
    assert _scheduler_info(server)["max_wait_ms"] != 10.0
    assert _update(server, {"max_wait_ms": 10.0}).status == 200


def test_only_the_admin_key_may_abort_every_request(server):
    # a rid is the client's own business; abort_all ends everybody's requests
    body = {"abort_all": True}
    for key in ("", USER):
        reply = server.request("POST", "/abort_request", body, headers=_as(key))
        assert_error_body(reply, 401)
    reply = server.request("POST", "/abort_request", {"rid": "nobody"}, headers=_as(USER))
    assert reply.status == 200 and reply.json()["aborted"] == []
    assert server.request("POST", "/abort_request", body, headers=_as(ADMIN)).status == 200
    # the other control routes still take the API key alone
    for path, req in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        assert_error_body(server.request("POST", path, req, headers=_as("")), 401)
        assert server.request("POST", path, req, headers=_as(USER)).status == 200


def test_a_switch_under_load_loses_no_request(server):
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(_generate, server, i) for i in range(12)]
        reply = _update(server, {"schedule_policy": "fcfs", "max_wait_ms": 250.0,
                                 "enable_priority_scheduling": True})  # fmt: skip
        outs = [f.result() for f in futures]
    assert reply.status == 200, reply.body
    assert all(o["meta_info"]["completion_tokens"] == 40 for o in outs)
    info = _scheduler_info(server)
    assert (info["schedule_policy"], info["max_wait_ms"]) == ("fcfs", 250.0)
    assert info["enable_priority_scheduling"] is True
    assert reply.json()["scheduler"] == info
    stats = _idle_stats(server)
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_usage"] == 0.0


def _idle_stats(server, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.request("GET", "/get_server_info", headers=_as(USER)).json()["stats"]
        if stats["num_running"] == stats["num_waiting"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_sglangs_set_internal_state_and_bounded_wait_off(server):
    body = {"server_args": {"schedule_policy": "dfs-weight", "max_wait_ms": None}}
    reply = _update(server, body, path="/set_internal_state")
    assert reply.status == 200, reply.body
    info = _scheduler_info(server)
    assert (info["schedule_policy"], info["max_wait_ms"]) == ("dfs-weight", None)
    assert _generate(server, 99)["meta_info"]["completion_tokens"] == 40


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_running_requests": 3}, "max_running_requests"),  # not a run-time setting
        ({"schedule_policy": "nope"}, "schedule_policy"),
        ({"max_wait_ms": -5}, "max_wait_ms"),
        ({"schedule_policy": None}, "schedule_policy"),
        ({}, "schedule_policy"),
    ],
)
def test_refused_settings_change_nothing(server, body, param):
    before = _scheduler_info(server)
    err = assert_error_body(_update(server, body), 400)
    assert err["param"] == param, err
    assert _scheduler_info(server) == before
