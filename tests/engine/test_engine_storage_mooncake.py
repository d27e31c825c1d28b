"""Issue 27, items 3 and 4, with real processes only: a Mooncake master and store process
(`tests/mooncake_harness.py`), and `radixserve serve` engines on the built-in SmolLM2-135M with
`--hicache-storage-backend mooncake`. Engine A prefills a 2,000-token prompt and writes its pages
to the store; A exits; engine B (another process) serves the same request by loading them: its
greedy output equals A's, its logprobs equal its own recomputation within 1e-4, and it reports the
loaded tokens as cached by the storage tier. Then the faults: a store down at start-up, a master
killed and restarted mid-run, pages gone mid-run."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time

import pytest

from mooncake_harness import MooncakeCluster, backend_ports
from server_harness import ServerProcess

pytest.importorskip("torch")

CHUNK = 256
rng = random.Random(27)
PROMPT = [rng.randrange(200, 40000) for _ in range(2000)]
LOADABLE = (len(PROMPT) - 1) // CHUNK * CHUNK  # whole chunks before the last token: 1792
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster():
    c = MooncakeCluster(segment_bytes=512 << 20)
    yield c
    c.stop()


@pytest.fixture
def procs():
    started: list[ServerProcess] = []
    yield started
    for p in reversed(started):
        if p.proc.poll() is None:
            p.stop(check=False)


def engine(cluster: MooncakeCluster, procs: list, policy: str = "wait_complete",
           **extra: object) -> ServerProcess:  # fmt: skip
    cfg = {"master_server_address": cluster.master_rpc, **backend_ports(cluster.client_env()),
           "chunk_size": CHUNK, **extra}  # fmt: skip
    p = ServerProcess(["--max-total-tokens", "4096", "--enable-hierarchical-cache",
                       "--hicache-ratio", "1.5", "--hicache-storage-backend", "mooncake",
                       "--hicache-storage-backend-extra-config", json.dumps(cfg),
                       "--hicache-storage-prefetch-policy", policy])  # fmt: skip
    procs.append(p)
    return p


def generate(p: ServerProcess, ids: list[int], salt: str | None = None) -> dict:
    body = {"input_ids": ids, "sampling_params": SP, "return_logprob": True}
    if salt:
        body["cache_salt"] = salt
    reply = p.post("/generate", body, timeout=300)
    assert reply.status == 200, reply.body
    return reply.json()


def wait_stat(p: ServerProcess, key: str, at_least: int, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = p.stats()
        if stats.get(key, 0) >= at_least:
            return stats
        assert time.monotonic() < deadline, f"{key} < {at_least}: {stats}"
        time.sleep(0.1)


def metric(p: ServerProcess, name: str) -> float:
    text = p.get("/metrics").body.decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def lps(out: dict) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def test_engine_b_loads_the_prefix_engine_a_computed(cluster, procs) -> None:
    a = engine(cluster, procs)
    out_a = generate(a, PROMPT)
    assert out_a["meta_info"]["cached_tokens"] == 0
    wait_stat(a, "storage_pages_written", LOADABLE // CHUNK)  # the 7 whole chunks
    a.stop()  # its pages live in the store process's segment, not in A

    b = engine(cluster, procs, rpc_timeout_ms=60000)  # a hung master holds a lookup a minute
    info = b.get("/get_server_info").json()["kv_store"]
    assert info["chunk_size"] == CHUNK and info["segment"] is None
    got = generate(b, PROMPT)
    meta = got["meta_info"]
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": LOADABLE}
    assert meta["cached_tokens"] == LOADABLE
    # B's own recomputation: another cache namespace, so no tier holds any of it
    recomputed = generate(b, PROMPT, salt="recompute")
    assert recomputed["meta_info"]["cached_tokens"] == 0
    assert got["output_ids"] == out_a["output_ids"] == recomputed["output_ids"]
    assert lps(got) == pytest.approx(lps(recomputed), abs=1e-4)
    # OpenAI usage: cached_tokens is the total, its details by tier
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    usage = b.post("/v1/completions", body, timeout=300).json()["usage"]
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] == sum(details["cached_tokens_details"].values()) > 0
    assert metric(b, 'radixserve_cached_tokens_by_tier_total{tier="storage"}') == LOADABLE
    assert metric(b, "radixserve_hicache_storage_bytes_read") > 0
    # held for their lookup: the loaded request and the salted one (a miss)
    assert metric(b, "radixserve_hicache_storage_prefetch_waits") == 2

    # a request waiting on its prefetch holds up no other: with the master hung (SIGSTOP), a
    # new prompt's lookup cannot finish, yet a short request (nothing to look up) is served
    os.kill(cluster.master.pid, signal.SIGSTOP)
    try:
        held: list[dict] = []
        t = threading.Thread(target=lambda: held.append(generate(b, prompt(99))), daemon=True)
        t.start()
        wait_stat(b, "storage_prefetch_waits", 3)  # it is held now
        short = generate(b, prompt(98, 100))
        assert short["meta_info"]["completion_tokens"] == SP["max_new_tokens"]
        assert t.is_alive() and not held  # still waiting for its prefetch
    finally:
        os.kill(cluster.master.pid, signal.SIGCONT)
    t.join(120)
    assert held and held[0]["meta_info"]["cached_tokens"] == 0


def test_a_prefetch_past_its_deadline_is_recomputed(cluster, procs) -> None:
    """`--hicache-storage-prefetch-policy timeout`: with the master hung, a request's lookup
    cannot finish; at its deadline (2 s + 0.1 s per 1,024 tokens) it is queued and computed
    while the master is still hung, and the timeout is counted."""
    t = engine(cluster, procs, "timeout", rpc_timeout_ms=60000)
    assert generate(t, prompt(97, 100))["meta_info"]["completion_tokens"] == SP["max_new_tokens"]
    os.kill(cluster.master.pid, signal.SIGSTOP)
    try:
        out = generate(t, prompt(96))  # answered although its lookup never finishes
        stats = t.stats()
    finally:
        os.kill(cluster.master.pid, signal.SIGCONT)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["meta_info"]["completion_tokens"] == SP["max_new_tokens"]
    assert stats["storage_prefetch_timeouts"] == 1


def prompt(seed: int, n: int = 600) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(200, 40000) for _ in range(n)]


def down_lines(p: ServerProcess) -> int:
    return sum("storage backend mooncake is down" in line for line in p.lines)


def test_faults_lose_no_request_and_never_load_wrong_bytes(cluster, procs) -> None:
    """Store down at start-up (serves, says so once, comes back when it is up), master killed
    and restarted mid-run (requests recompute meanwhile; the tier comes back empty and fills
    again), the holder of the pages killed (listed but unreadable: recomputed)."""
    cluster.kill_master()
    c = engine(cluster, procs, down_duration_s=2)
    first = generate(c, prompt(1))
    generate(c, prompt(2))
    assert first["meta_info"]["cached_tokens"] == 0
    assert c.stats()["storage_up"] == 0 and down_lines(c) == 1  # said once, not per request

    cluster.start_master()
    cluster.wait_store_mounted()
    time.sleep(2.5)  # the down duration: the next call reconnects
    generate(c, prompt(3))
    wait_stat(c, "storage_pages_written", 2)  # back: prompt 3's two chunks are in the store
    assert c.stats()["storage_up"] == 1

    cluster.kill_master()  # mid-run: every key is lost with it
    assert generate(c, prompt(4))["meta_info"]["cached_tokens"] == 0  # recomputed, no error
    cluster.start_master()
    cluster.wait_store_mounted()
    time.sleep(2.5)
    p5 = prompt(5)
    want = generate(c, p5)
    wait_stat(c, "storage_pages_written", 4)  # the tier is back: prompt 5 written
    assert c.post("/flush_cache", {}).status == 200
    got = generate(c, p5)
    assert got["meta_info"]["cached_tokens_details"]["storage"] == 512
    assert got["output_ids"] == want["output_ids"]

    cluster.kill_store()  # the holder: its keys stay listed a while, reads fail
    assert c.post("/flush_cache", {}).status == 200
    failures = c.stats()["storage_prefetch_failures"]
    again = generate(c, p5)
    assert again["meta_info"]["cached_tokens"] == 0  # recomputed, not loaded
    assert again["output_ids"] == want["output_ids"]
    assert c.stats()["storage_prefetch_failures"] == failures + 1
    assert not c.errors()
    cluster.start_store()


def test_pages_pinned_for_a_hung_writer_are_never_evicted(cluster, procs) -> None:
    """The writer reads a prompt's pages off the scheduler thread, after asking the store; until
    it has, they are pinned. With the master hung (SIGSTOP) the writer waits in that call while
    two other prompts need the device pool (4,096 slots) and evict everything they can (their
    own pages are not offered: the pins out are bounded by half the pool); once the master
    answers, the writer reads the pinned pages, untouched, and stores them: engine B loads them
    with A's output and logprobs within 1e-4, and A's pin is gone."""
    a = engine(cluster, procs, "timeout", rpc_timeout_ms=180000)
    os.kill(cluster.master.pid, signal.SIGSTOP)
    try:
        out_a = generate(a, PROMPT)  # its lookup hangs: computed at its deadline
        held = a.stats()
        assert held["storage_write_pinned_tokens"] >= LOADABLE
        for seed in (61, 62):  # 2 x 1,208 tokens > the 2,089 slots left: they evict
            generate(a, prompt(seed, 1200))
        stats = a.stats()
    finally:
        os.kill(cluster.master.pid, signal.SIGCONT)
    assert stats["storage_pages_written"] == 0 and stats["storage_pages_gathered"] == 0
    assert stats["storage_write_pinned_tokens"] == held["storage_write_pinned_tokens"]
    assert stats["storage_write_dropped_pages"] == 2 * (1200 // CHUNK)  # bounded: not pinned
    stats = wait_stat(a, "storage_pages_written", LOADABLE // CHUNK)
    assert stats["storage_pages_gathered"] == LOADABLE // CHUNK
    deadline = time.monotonic() + 30
    while a.stats()["storage_write_pinned_tokens"]:
        assert time.monotonic() < deadline, "the pin was never released"
        time.sleep(0.1)

    b = engine(cluster, procs, rpc_timeout_ms=60000)
    got = generate(b, PROMPT)
    assert got["meta_info"]["cached_tokens_details"]["storage"] == LOADABLE
    assert got["output_ids"] == out_a["output_ids"]
    assert lps(got) == pytest.approx(lps(out_a), abs=1e-4)
