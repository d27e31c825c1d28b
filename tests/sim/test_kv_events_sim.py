"""`radixserve serve --sim ... --kv-events-config`: a plain pyzmq + msgpack subscriber (decoding
vLLM's wire format here, not through any router code) sees each prompt's full blocks with
cache/hashing.py's chained hashes, once; removals under KV pressure; AllBlocksCleared on
/flush_cache; replay through the ROUTER socket; a snapshot that agrees with the stream."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import msgpack
import pytest
import zmq

from radixserve.cache.hashing import block_hashes
from server_harness import ServerProcess

BLOCK = 4
TOPIC = b"kv-test"
KV_TOKENS = 512  # small, so that a few prompts push blocks out
END = (-1).to_bytes(8, "big", signed=True)


def greedy(n: int = 1) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


class Subscriber:
    """Every batch the server publishes, decoded: (seq, ts, events)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.subscribe(TOPIC)
        self.batches: list[tuple[int, float, list[dict[str, Any]]]] = []
        self.raw: dict[int, bytes] = {}

    def poll(self, timeout_s: float) -> bool:
        if not self.sock.poll(int(timeout_s * 1000)):
            return False
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == TOPIC and len(seq) == 8
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        self.batches.append((int.from_bytes(seq, "big"), ts, events))
        self.raw[int.from_bytes(seq, "big")] = payload
        return True

    def until(self, done, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"no such event; got {self.events()[-5:]}"
            self.poll(0.2)

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        return [e for _, _, evs in self.batches[since:] for e in evs]


@pytest.fixture(scope="module")
def fleet():
    cfg = {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
           "topic": TOPIC.decode(), "block_size": BLOCK, "buffer_steps": 100000}  # fmt: skip
    server = ServerProcess(["--sim", "tiny-cpu", "--max-total-tokens", str(KV_TOKENS),
                            "--kv-events-config", json.dumps(cfg)])  # fmt: skip
    ctx = zmq.Context()
    info = server.get("/get_server_info").json()["kv_events"]
    sub = Subscriber(ctx, info["endpoint"])
    # a SUB socket misses what is sent before its subscription arrives: flush (an empty cache
    # still announces AllBlocksCleared) until one is seen
    deadline = time.monotonic() + 30
    while not sub.poll(0.3):
        assert time.monotonic() < deadline, "no event reached the subscriber"
        assert server.post("/flush_cache", b"").status == 200
    yield server, sub, info, ctx
    ctx.destroy(0)
    server.stop()


def stored(events: list[dict[str, Any]]) -> list[int]:
    return [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]


def removed(events: list[dict[str, Any]]) -> list[int]:
    return [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]


def run(server: ServerProcess, ids: list[int], **extra: Any) -> None:
    reply = server.post("/generate", {"input_ids": ids, "sampling_params": greedy(), **extra})
    assert reply.status == 200, reply.body


def flush(server: ServerProcess, sub: Subscriber) -> None:
    mark = len(sub.batches)
    assert server.post("/flush_cache", b"").json()["success"] is True
    sub.until(lambda: any(e["type"] == "AllBlocksCleared" for e in sub.events(mark)))


def test_server_info_names_where_events_go(fleet):
    server, _, info, _ = fleet
    assert info["endpoint"].startswith("tcp://127.0.0.1:") and info["topic"] == "kv-test"
    assert info["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert (info["block_size"], info["hash_algo"], info["publisher"]) == (4, "xxhash64", "zmq")
    assert server.get("/get_server_info").json()["engine"]["kv_events"] == info


def test_a_prompts_full_blocks_are_stored_once_with_chained_hashes(fleet):
    server, sub, _, _ = fleet
    flush(server, sub)
    prompt = list(range(100, 142))  # 42 tokens: 10 full blocks (the 1 output is not cached)
    mark = len(sub.batches)
    run(server, prompt)
    want = block_hashes(prompt, BLOCK, "xxhash64")
    sub.until(lambda: set(want) <= set(stored(sub.events(mark))))
    events = [e for e in sub.events(mark) if e["type"] == "BlockStored"]
    assert stored(events) == want, "each full block once, in order, nothing else"
    for e in events:  # token ids and parent links let a subscriber rebuild the chain
        i = want.index(e["block_hashes"][0])
        assert e["parent_block_hash"] == (want[i - 1] if i else None)
        assert e["token_ids"] == prompt[i * BLOCK : (i + len(e["block_hashes"])) * BLOCK]
        assert (e["block_size"], e["medium"], e["lora_id"], e["lora_name"]) == (4, "GPU", None,
                                                                                 None)  # fmt: skip
        assert e["extra_keys"] == [None] * len(e["block_hashes"])
    seqs = [s for s, _, _ in sub.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "seq counts batches without gaps"

    # the same prompt again, and one that branches inside block 5 (a split): nothing re-announced
    mark = len(sub.batches)
    run(server, prompt)
    branch = prompt[:22] + list(range(900, 920))
    run(server, branch)
    want_branch = block_hashes(branch, BLOCK, "xxhash64")
    sub.until(lambda: set(want_branch[5:]) <= set(stored(sub.events(mark))))
    assert stored(sub.events(mark)) == want_branch[5:]
    assert not removed(sub.events(mark))


def test_cache_salt_namespaces_hash_apart(fleet):
    server, sub, _, _ = fleet
    flush(server, sub)
    prompt = list(range(300, 313))  # 3 full blocks
    mark = len(sub.batches)
    run(server, prompt)
    run(server, prompt, cache_salt="tenant-a")
    salted = block_hashes(prompt, BLOCK, "xxhash64", 0, "salt:tenant-a")
    plain = block_hashes(prompt, BLOCK, "xxhash64")
    sub.until(lambda: set(salted) | set(plain) <= set(stored(sub.events(mark))))
    assert set(salted).isdisjoint(plain)
    first = next(e for e in sub.events(mark) if salted[0] in e.get("block_hashes", ()))
    assert first["extra_keys"][0] == ["tenant-a"] and first["parent_block_hash"] is None


def test_kv_pressure_removes_blocks_and_the_snapshot_matches_the_stream(fleet):
    server, sub, _, _ = fleet
    flush(server, sub)
    mark = len(sub.batches)
    prompts = [[7000 + 100 * i + j for j in range(120)] for i in range(8)]  # 960 > 512 tokens
    for p in prompts:
        run(server, p)
    first = block_hashes(prompts[0], BLOCK, "xxhash64")
    sub.until(lambda: set(first) <= set(removed(sub.events(mark))))
    server.wait_idle()
    snap = server.get("/kv_events/snapshot").json()
    sub.until(lambda: sub.batches[-1][0] >= snap["seq"])
    held: set[int] = set()
    for seq, _, events in sub.batches[mark:]:  # the stream since the flush, up to the snapshot
        if seq > snap["seq"]:
            break
        for e in events:
            if e["type"] == "BlockStored":
                assert held.isdisjoint(e["block_hashes"]), "stored twice without a removal"
                held.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                held.difference_update(e["block_hashes"])
    blocks = snap["blocks"]
    assert {b["block_hash"] for b in blocks} == held and len(blocks) == len(held)
    assert (snap["block_size"], snap["hash_algo"]) == (BLOCK, "xxhash64")
    seen: set[int | None] = {None}
    for b in blocks:  # parents before children, each block's tokens hash to its key
        assert b["parent_block_hash"] in seen
        seen.add(b["block_hash"])
        assert len(b["token_ids"]) == BLOCK
    last = prompts[-1]
    assert set(block_hashes(last, BLOCK, "xxhash64")) <= held, "the newest prompt is cached"
    metrics = server.get("/metrics").body.decode()
    assert f"radixserve_kv_events_blocks {float(len(held))}" in metrics


def test_flush_cache_announces_all_blocks_cleared_and_empties_the_snapshot(fleet):
    server, sub, _, _ = fleet
    run(server, list(range(500, 520)))
    flush(server, sub)
    assert sub.batches[-1][2] == [{"type": "AllBlocksCleared"}]
    snap = server.get("/kv_events/snapshot").json()
    assert snap["blocks"] == [] and snap["seq"] == sub.batches[-1][0]


def test_replay_resends_a_range_then_the_end_marker(fleet):
    server, sub, info, ctx = fleet
    mark = len(sub.batches)
    for i in range(3):
        run(server, list(range(600 + 100 * i, 630 + 100 * i)))
    sub.until(lambda: len(sub.batches) >= mark + 3)
    start = sub.batches[-3][0]
    top = sub.batches[-1][0]
    # vLLM's framing: a delimiter frame, answered [b"", seq, payload] ... [b"", -1, b""]
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(info["replay_endpoint"])
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = recv_replay(dealer)
    assert [f[1] for f in got[-1:]] == [END] and got[-1][0] == b"" and got[-1][2] == b""
    replayed = {int.from_bytes(f[1], "big"): f for f in got[:-1]}
    assert min(replayed) == start and max(replayed) >= top
    for seq in range(start, top + 1):
        assert replayed[seq][0] == b"" and replayed[seq][2] == sub.raw[seq], seq
    # a bare request (no delimiter) gets the topic in the first frame
    bare = ctx.socket(zmq.DEALER)
    bare.connect(info["replay_endpoint"])
    bare.send(top.to_bytes(8, "big"))
    got = recv_replay(bare)
    assert got[0][0] == TOPIC and got[0][1] == top.to_bytes(8, "big")
    assert got[0][2] == sub.raw[top] and got[-1] == [b"", END, b""]


def recv_replay(sock: zmq.Socket) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    while not out or out[-1][1] != END:
        assert sock.poll(10_000), "the replay did not end"
        out.append(sock.recv_multipart())
    return out


def test_the_null_publisher_tracks_blocks_and_sends_nothing():
    cfg = {"publisher": "null", "block_size": 2}
    server = ServerProcess(["--sim", "tiny-cpu", "--kv-events-config", json.dumps(cfg)])
    try:
        info = server.get("/get_server_info").json()["kv_events"]
        assert info["publisher"] == "null" and info["endpoint"] is None
        run(server, [1, 2, 3, 4, 5])
        server.wait_idle()
        snap = server.get("/kv_events/snapshot").json()
        assert [b["block_hash"] for b in snap["blocks"]] == block_hashes(
            [1, 2, 3, 4], 2, "xxhash64"
        )
    finally:
        server.stop()


def test_snapshot_is_refused_without_kv_events():
    server = ServerProcess(["--sim", "tiny-cpu"])
    try:
        reply = server.get("/kv_events/snapshot")
        assert reply.status == 404 and reply.json()["error"]["code"] == "kv_events_disabled"
        assert server.get("/get_server_info").json()["kv_events"] is None
    finally:
        server.stop()


@pytest.mark.parametrize(
    "config,message",
    [
        ('{"endpont": "tcp://*:1"}', "unknown key(s) endpont"),
        ('{"block_size": "16"}', "block_size must be of type int"),
        ('{"publisher": "kafka"}', 'publisher must be "zmq" or "null"'),
        ('{"hash_seed": -1}', "hash_seed must be in [0, 2**64)"),
        ('{"hash_algo": "md5"}', "hash_algo must be one of"),
        ("[1]", "must be a JSON object"),
        ("{", "not valid JSON"),
    ],
)
def test_bad_configs_are_one_line_cli_errors(config, message):
    cmd = [sys.executable, "-m", "radixserve", "serve", "--sim", "tiny-cpu", "--port", "0",
           "--kv-events-config", config]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"--kv-events-config: {message}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_an_address_in_use_fails_the_start_in_one_line():
    blocker = zmq.Context.instance().socket(zmq.PUB)
    port = blocker.bind_to_random_port("tcp://127.0.0.1")
    try:  # an address with a * is bound (vLLM's rule), so a port in use fails the start
        cmd = [sys.executable, "-m", "radixserve", "serve", "--sim", "tiny-cpu", "--port", "0",
               "--kv-events-config", json.dumps({"endpoint": f"tcp://*:{port}"})]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        blocker.close(0)
    assert proc.returncode == 1 and "--kv-events-config" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_python_engine_takes_the_same_config():
    from radixserve.engine.engine import Engine

    with pytest.raises(ValueError, match="unknown key"):
        Engine(sim="tiny-cpu", kv_events_config={"endpoit": "x"})
    cfg = {"endpoint": "tcp://127.0.0.1:*", "block_size": BLOCK, "topic": "kv-test"}
    with Engine(sim="tiny-cpu", kv_events_config=cfg) as engine:
        ctx = zmq.Context()
        try:
            sub = Subscriber(ctx, engine.procs.info["kv_events"]["endpoint"])
            deadline = time.monotonic() + 30
            while not sub.poll(0.3):
                assert time.monotonic() < deadline
                engine.flush_cache()
            engine.generate(input_ids=list(range(40, 49)), sampling_params=greedy())
            want = block_hashes(list(range(40, 49)), BLOCK, "xxhash64")
            sub.until(lambda: set(want) <= set(stored(sub.events())))
        finally:
            ctx.destroy(0)
