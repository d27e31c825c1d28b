"""The real engine (a tiny random-weight Llama through the real loader) publishes KV events the
same way `serve --sim` does: a prompt's full blocks, hashed as cache/hashing.py says, with
SHA-256 as the configured hash."""

from __future__ import annotations

import json
import time

import msgpack
import zmq

from radixserve.cache.hashing import block_hashes
from server_harness import TINY_SERVER_ARGS, ServerProcess


def test_the_real_engine_publishes_a_prompts_blocks(tiny_model_dir):
    cfg = {"endpoint": "tcp://127.0.0.1:*", "block_size": 8, "hash_algo": "sha256",
           "hash_seed": 3}  # fmt: skip
    server = ServerProcess(["--model", str(tiny_model_dir), *TINY_SERVER_ARGS,
                            "--kv-events-config", json.dumps(cfg)])  # fmt: skip
    ctx = zmq.Context()
    try:
        info = server.get("/get_server_info").json()["kv_events"]
        assert (info["block_size"], info["hash_algo"]) == (8, "sha256")
        sub = ctx.socket(zmq.SUB)
        sub.connect(info["endpoint"])
        sub.subscribe(b"")
        deadline = time.monotonic() + 30
        while not sub.poll(300):  # until the subscription is through
            assert time.monotonic() < deadline
            server.post("/flush_cache", b"")
        prompt = [(7 * i) % 250 + 5 for i in range(30)]  # 3 full blocks of 8
        reply = server.post("/generate", {"input_ids": prompt, "sampling_params":
                            {"max_new_tokens": 1, "temperature": 0}})  # fmt: skip
        assert reply.status == 200, reply.body
        want = [int(h[-16:], 16) for h in block_hashes(prompt, 8, "sha256", 3)]
        got: list[int] = []
        while not set(want) <= set(got):
            assert sub.poll(15_000), f"no BlockStored for the prompt; got {got}"
            _, _, payload = sub.recv_multipart()
            ts, events, rank = msgpack.unpackb(payload)
            got += [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
        assert got == want
        snap = server.get("/kv_events/snapshot").json()
        assert [b["block_hash"] for b in snap["blocks"]] == want
        assert snap["blocks"][1]["token_ids"] == prompt[8:16]
    finally:
        ctx.destroy(0)
        server.stop()
