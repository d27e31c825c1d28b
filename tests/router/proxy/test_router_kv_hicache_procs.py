"""`route --policy kv_aware` in front of real engines with a host tier (issue 28, item 3): engine
A computes a prefix, its small device pool pushes the prefix out to A's host memory, A's KV events
say so (medium "CPU"), and the router sends a later request sharing the prefix to A, which loads
it from its host tier instead of computing it; the workers that hold nothing are not preferred.
All real processes (tiny random-weight Llama through the real loader), real HTTP and ZeroMQ."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")
pytest.importorskip("httptools")

from server_harness import ServerProcess  # noqa: E402
from test_router_fleet import RouterProc  # noqa: E402
from test_router_kv_procs import events_config, wait_for  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

POOL = 256  # device slots: two 110-token prompts push a 96-token prefix out
BLOCK = 16  # KV events' block size (the engine's default)
rng = random.Random(28)
SHARED = [rng.randrange(4, 300) for _ in range(6 * BLOCK)]
FIRST = SHARED + [rng.randrange(4, 300) for _ in range(7)]
FILLERS = [[rng.randrange(4, 300) for _ in range(110)] for _ in range(2)]
LATER = SHARED + [rng.randrange(4, 300) for _ in range(9)]
SP = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in reversed(started):
        if p.proc.poll() is None:
            p.stop()


def engine(model: str) -> ServerProcess:
    return ServerProcess(["--model", model, "--max-total-tokens", str(POOL),
                          "--context-length", "256", "--enable-hierarchical-cache",
                          "--hicache-ratio", "4", "--kv-events-config", events_config()])  # fmt: skip


def generate(p: ServerProcess, ids: list[int]) -> dict:
    reply = p.post("/generate", {"input_ids": ids, "sampling_params": SP}, timeout=120)
    assert reply.status == 200, reply.body
    return reply.json()


def test_a_prefix_in_a_s_host_tier_is_routed_to_a_and_loaded_from_host(procs, tmp_path):
    model = str(build_tiny_model("llama3", tmp_path))
    workers = [engine(model) for _ in range(3)]
    procs.extend(workers)
    a = workers[1]
    router = RouterProc([w.url for w in workers], "--policy", "kv_aware")
    procs.append(router)
    metric = lambda name, w=a: router.metrics().get(f"{name}@{w.url}", 0)  # noqa: E731
    wait_for(lambda: all(metric("worker_healthy", w) == 1 for w in workers), "healthy workers")

    # straight to A: the router learns of it from A's KV events alone
    assert generate(a, FIRST)["meta_info"]["cached_tokens"] == 0
    wait_for(lambda: metric("kv_index_blocks") >= len(SHARED) // BLOCK, "A's device blocks")
    for ids in FILLERS:  # device pressure on A: the prefix moves to A's host tier
        generate(a, ids)
    wait_for(lambda: metric("kv_index_lower_blocks") >= len(SHARED) // BLOCK, "A's host blocks")
    for w in workers:
        if w is not a:
            assert metric("kv_index_blocks", w) == 0 and metric("kv_index_lower_blocks", w) == 0

    before = router.metrics()
    sent = router.requests_per_worker()
    status, out = router.call("POST", "/generate", {"input_ids": LATER, "sampling_params": SP})
    assert status == 200, out
    now = router.requests_per_worker()
    assert [u for u in now if now[u] != sent.get(u)] == [a.url]  # routed to the host holder
    details = out["meta_info"]["cached_tokens_details"]
    assert details["host"] >= len(SHARED) - BLOCK, details  # loaded from A's host tier
    assert out["meta_info"]["cached_tokens"] == sum(details.values())
    after = router.metrics()
    loaded = after["kv_expected_loaded_tokens_total"] - before["kv_expected_loaded_tokens_total"]
    assert loaded >= len(SHARED) - BLOCK  # the router chose A for what it can load, not compute
