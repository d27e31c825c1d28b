"""`route --policy kv_aware` in front of three `serve --sim` workers that publish KV events (issue
12, acceptance 5): all real processes, real HTTP and ZeroMQ. What the router expects is read from
its /metrics (prompt tokens dispatched, and those it expected the chosen worker to hold), where
each request went from /workers."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from server_harness import ServerProcess
from test_router_fleet import RouterProc

pytest.importorskip("httptools")

KV_TOKENS = 1024  # small: a few prompts push a prefix out
WORDS = 160  # tokens of a prompt (one per word): 10 blocks of 16


def events_config(port: int = 0, replay: int = 0) -> str:
    # vLLM's rule: an address with a wildcard is bound, another connected to
    where = lambda p: f"tcp://*:{p}" if p else "tcp://127.0.0.1:*"  # noqa: E731
    return json.dumps({"endpoint": where(port), "replay_endpoint": where(replay)})


def worker(*extra: str, port: int = 0, replay: int = 0) -> ServerProcess:
    return ServerProcess(["--sim", "tiny-cpu", "--max-total-tokens", str(KV_TOKENS),
                          "--kv-events-config", events_config(port, replay), *extra])  # fmt: skip


def prompt(tag: str, n: int = WORDS) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def generate(target, text: str) -> None:
    body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
    if isinstance(target, RouterProc):
        status, reply = target.call("POST", "/generate", body)
    else:
        reply = target.post("/generate", body)
        status = reply.status
    assert status == 200, reply


def expected_hit(router: RouterProc, text: str) -> tuple[float, str]:
    """Send `text` through the router: (tokens it expected the chosen worker to hold, url)."""
    before, sent = router.metrics(), router.requests_per_worker()
    generate(router, text)
    after, now = router.metrics(), router.requests_per_worker()
    [url] = [u for u in now if now[u] != sent.get(u)]
    key = "kv_expected_hit_tokens_total"
    return after[key] - before[key], url


def wait_for(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def healthy(router: RouterProc, url: str) -> bool:
    _, body = router.call("GET", "/workers")
    return any(w["url"] == url and w["healthy"] for w in body["workers"])


def blocks(router: RouterProc, url: str) -> float:
    return router.metrics().get(f"kv_index_blocks@{url}", -1)


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in reversed(started):
        if p.proc.poll() is None:  # a worker the test stopped itself is gone already
            p.stop()


def test_holder_gets_the_prefix_until_flush_or_pressure_evicts_it(procs):
    workers = [worker() for _ in range(3)]
    procs.extend(workers)
    holder = workers[1]
    shared = prompt("shared")
    # served before the router exists: the router learns it by replaying the worker's history
    generate(holder, shared)
    router = RouterProc([w.url for w in workers], "--policy", "kv_aware")
    procs.append(router)
    wait_for(lambda: blocks(router, holder.url) >= WORDS // 16, "the holder's blocks")
    for i in range(3):
        hit, url = expected_hit(router, shared + f" question{i}")
        assert url == holder.url and hit >= WORDS - 15  # all whole blocks of the prefix
    # /flush_cache on the worker itself (not through the router): AllBlocksCleared
    assert holder.post("/flush_cache", b"").status == 200
    wait_for(lambda: blocks(router, holder.url) == 0, "AllBlocksCleared")
    hit, url = expected_hit(router, shared + " again")
    assert hit == 0  # the router's own tree still says the holder has it; the index knows not
    # KV pressure: other prompts sent straight to the new holder push the prefix out
    pressed = next(w for w in workers if w.url == url)
    for k in range(2 * KV_TOKENS // WORDS):
        generate(pressed, prompt(f"filler{k}x"))
    wait_for(lambda: blocks(router, pressed.url) <= KV_TOKENS // 16, "removals")
    hit, _ = expected_hit(router, shared + " once more")
    assert hit < WORDS // 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restarted_worker_loses_its_stale_entries(procs):
    ports = [free_port() for _ in range(3)]
    first = worker("--port", str(ports[0]), port=ports[1], replay=ports[2])
    procs.append(first)
    router = RouterProc([first.url], "--policy", "kv_aware")
    procs.append(router)
    generate(first, prompt("old"))
    wait_for(lambda: blocks(router, first.url) >= WORDS // 16, "the first life's blocks")
    first.stop(check=False)
    again = worker("--port", str(ports[0]), port=ports[1], replay=ports[2])
    procs.append(again)
    generate(again, prompt("new"))  # the new life publishes from seq 0 again
    # the router sees the PUB connection come back (or seq start over) and rebuilds the worker
    # from the new life's replay buffer: its blocks only, none of the old life's
    wait_for(lambda: blocks(router, again.url) == WORDS // 16, "only the new life's blocks")
    # the health checks that failed while it was down keep the worker out of routing until one
    # succeeds again: route only once the router counts the new life healthy
    wait_for(lambda: healthy(router, again.url), "the router to see the new life healthy")
    hit, _ = expected_hit(router, prompt("old"))
    assert hit == 0


def test_a_worker_is_admitted_before_its_first_request(procs):
    """POST /workers checks a kv_aware worker's tokenizer before the worker can take traffic:
    a `serve --sim` worker (a word tokenizer) is refused with a 409 naming why behind a router
    that tokenizes as SmolLM2, and never listed; behind a router that adopts the worker's own
    tokenizer it is admitted (201) and serves through the router."""
    w = worker()
    procs.append(w)
    strict = RouterProc([], "--policy", "kv_aware", "--tokenizer", "built-in:SmolLM2-135M")
    procs.append(strict)
    status, body = strict.call("POST", "/workers", {"url": w.url})
    assert status == 409, body
    assert "tokenizer" in body["error"]["message"]
    assert strict.call("GET", "/workers")[1]["workers"] == []
    adopting = RouterProc([], "--policy", "kv_aware")
    procs.append(adopting)
    assert adopting.call("POST", "/workers", {"url": w.url})[0] == 201
    generate(adopting, prompt("admitted"))
    assert adopting.requests_per_worker() == {w.url: 1}


def test_kv_events_of_workers_behind_an_api_key(procs):
    """`--worker-api-key` reaches the workers' info endpoints too: the router learns the
    tokenizer and the event endpoint of a worker behind `--api-key`, and indexes its blocks."""
    w = worker("--api-key", "worker-key")
    procs.append(w)
    router = RouterProc([w.url], "--policy", "kv_aware", "--worker-api-key", "worker-key")
    procs.append(router)
    generate(router, prompt("keyed"))
    wait_for(lambda: blocks(router, w.url) >= WORDS // 16, "the worker's blocks indexed")


def test_pending_prefill_is_reconciled_with_what_workers_report(procs):
    # Workers report their waiting prefill tokens in /get_loads; the router polls them after
    # each health probe, and a dispatch the report covers stops counting as pending, so a
    # request in its decode phase no longer weighs on its worker as unfinished prefill.
    workers = [worker() for _ in range(2)]
    procs.extend(workers)
    idle = workers[0].get("/get_loads").json()
    assert idle["waiting_prefill_tokens"] == 0 and idle["num_waiting"] == 0
    router = RouterProc([w.url for w in workers], "--policy", "kv_aware",
                        "--health-check-interval-secs", "0.1")  # fmt: skip
    procs.append(router)

    def rows() -> dict[str, dict]:
        return {w["url"]: w for w in router.call("GET", "/get_loads")[1]["workers"]}

    wait_for(lambda: all(r["reported_prefill_tokens"] == 0 for r in rows().values()), "reports")
    body = {"text": prompt("long"), "stream": True,
            "sampling_params": {"max_new_tokens": 800, "ignore_eos": True}}  # fmt: skip
    conn = http.client.HTTPConnection(router.addr, timeout=60)
    conn.request("POST", "/generate", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()  # the first token is out: the prompt is prefilled, decode goes on
    [busy] = [r for r in rows().values() if r["load"] == 1]
    # counted at dispatch (a hit on nothing: the whole prompt), until a report covers it
    wait_for(lambda: rows()[busy["url"]]["pending_prefill_tokens"] == 0, "reconciliation")
    assert rows()[busy["url"]]["load"] == 1  # still decoding
    conn.close()


def test_a_sim_worker_reports_its_cost_model_s_ratios_and_the_router_reads_them(procs):
    """A `serve --sim` worker with a host tier reports its cost model's load-to-prefill ratio
    for it in /get_loads (and none for a store it does not have); the router's poll reads it
    into what kv_aware's tier-aware score charges that worker."""
    from radixserve.sim.costmodel import get_cost_model

    w = worker("--enable-hierarchical-cache", "--hicache-ratio", "2")
    procs.append(w)
    want = float(f"{get_cost_model('tiny-cpu').host_load_to_prefill_ratio():.3g}")
    loads = w.get("/get_loads").json()
    assert loads["kv_load_to_prefill_ratio"] == want > 0
    assert loads["kv_store_load_to_prefill_ratio"] is None
    router = RouterProc([w.url], "--policy", "kv_aware", "--health-check-interval-secs", "0.1")
    procs.append(router)

    def row() -> dict:
        return router.call("GET", "/get_loads")[1]["workers"][0]

    wait_for(lambda: row().get("kv_load_to_prefill_ratio") == want, "the ratio read")
    assert row()["kv_store_load_to_prefill_ratio"] is None
