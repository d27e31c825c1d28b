"""Joining workers take load gradually (issue 15): a worker added to a fleet under traffic, or
back with an empty cache, is not handed every new prefix because its tree is the smallest."""

from __future__ import annotations

import json
import threading

import pytest

from radixserve.router.policies.base import RequestView, WorkerView  # noqa: E402
from radixserve.router.policies.config import CachePolicyConfig  # noqa: E402
from radixserve.router.policies.registry import create_policy  # noqa: E402


def share_of_joiner(warmup_secs: float) -> float:
    policy = create_policy("cache_aware", CachePolicyConfig(warmup_secs=warmup_secs))
    fleet, now = [WorkerView(f"w{i}") for i in range(3)], 0.0
    for i in range(2400):
        view = RequestView.from_prompt(text=f"old prefix {i} " * 30)
        policy.on_dispatch(fleet[policy.select(fleet, view, now)].id, view, now)
        now += 0.01
    fleet.append(WorkerView("new"))
    got = 0
    for i in range(800):  # the next 8 s of new prefixes
        view = RequestView.from_prompt(text=f"new prefix {i} " * 30)
        pick = fleet[policy.select(fleet, view, now)].id
        policy.on_dispatch(pick, view, now)
        got += pick == "new"
        now += 0.01
    return got / 800


def test_a_joining_worker_gets_about_its_fair_share_of_new_prefixes():
    assert share_of_joiner(0.0) > 0.8  # the herd, without warm-up
    assert 0.2 <= share_of_joiner(60.0) <= 0.4  # 1/4 at first, rising over 60 s


pytest.importorskip("httptools")

from test_router_app import FakeWorker, call, make_router  # noqa: E402, F401


def test_a_worker_added_under_load_ramps_up(make_router):  # noqa: F811
    fleet = [FakeWorker(f"old{i}") for i in range(3)]
    joiner = FakeWorker("joiner")
    try:
        r = make_router([w.url for w in fleet])

        def load(tag: str, n: int, served: list[str]) -> None:
            for i in range(n):
                body = {"text": f"{tag} conversation {i} " * 20}
                served.append(call("POST", r.addr, "/generate", body)[1]["meta_info"]["worker"])

        before: list[str] = []
        users = [threading.Thread(target=load, args=(f"u{u}", 50, before)) for u in range(6)]
        for t in users:
            t.start()
        for t in users:
            t.join()
        after: list[str] = []
        users = [threading.Thread(target=load, args=(f"v{u}", 60, after)) for u in range(6)]
        for t in users:
            t.start()
        assert call("POST", r.addr, "/workers", {"url": joiner.url})[0] == 201  # under load
        for t in users:
            t.join()
    finally:
        for w in [*fleet, joiner]:
            w.kill()
    share = after.count("joiner") / len(after)
    assert 0.1 < share < 0.35, json.dumps({w: after.count(w) for w in set(after)})
