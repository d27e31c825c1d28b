"""`radixserve serve` on the tiny model through raw HTTP, as curl sends it: SGLang's /generate,
health, info, cache and metrics endpoints; 32 concurrent clients; clients that disconnect."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_harness import ServerProcess, assert_error_body

MAX_NEW = 8
SAMPLING = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PROMPT = "the capital of france is paris and"
METRICS = (
    "radixserve_num_running_reqs",
    "radixserve_num_queue_reqs",
    "radixserve_token_usage",
    "radixserve_cache_hit_rate",
    "radixserve_prompt_tokens_total",
    "radixserve_cached_tokens_total",
    "radixserve_generation_tokens_total",
    "radixserve_time_to_first_token_seconds_bucket",
    "radixserve_inter_token_latency_seconds_bucket",
    "radixserve_e2e_request_latency_seconds_bucket",
    "radixserve_engine_up",
)


def generate(server: ServerProcess, **body) -> dict:
    reply = server.post("/generate", {"sampling_params": SAMPLING, **body})
    assert reply.status == 200, reply.body
    return reply.json()


def metrics(server: ServerProcess) -> dict[str, float]:
    """/metrics as {sample name with labels: value}."""
    reply = server.get("/metrics")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    out = {}
    for line in reply.body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_generate_with_text_or_input_ids(tiny_server):
    out = generate(tiny_server, text=PROMPT)
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == MAX_NEW
    assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}
    assert meta["prompt_tokens"] > 5 and meta["cached_tokens"] < meta["prompt_tokens"]
    info = tiny_server.get("/get_model_info").json()
    assert all(0 <= t < info["vocab_size"] for t in out["output_ids"])
    # the same prompt as token ids: the same tokens and text, now mostly from the cache
    ids_prompt = generate(tiny_server, input_ids=[0, 5, 6, 7, 8, 9, 10, 11])
    ids_again = generate(tiny_server, input_ids=[0, 5, 6, 7, 8, 9, 10, 11])
    assert ids_again["output_ids"] == ids_prompt["output_ids"]
    assert ids_again["text"] == ids_prompt["text"]
    assert ids_again["meta_info"]["prompt_tokens"] == 8
    assert ids_again["meta_info"]["cached_tokens"] == 7


def test_generate_batch(tiny_server):
    prompts = [PROMPT, "a radix tree shares"]
    alone = [generate(tiny_server, text=p) for p in prompts]
    batch = tiny_server.post("/generate", {"text": prompts, "sampling_params": SAMPLING}).json()
    assert [b["output_ids"] for b in batch] == [a["output_ids"] for a in alone]
    assert [b["index"] for b in batch] == [0, 1]


def test_generate_stream_ends_with_done(tiny_server):
    whole = generate(tiny_server, text=PROMPT)
    reply = tiny_server.post("/generate", {"text": PROMPT, "stream": True,
                             "sampling_params": SAMPLING})  # fmt: skip
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    *chunks, done = reply.events()
    assert done == "[DONE]"
    chunks = [json.loads(c) for c in chunks]
    assert len(chunks) == MAX_NEW  # one token per step
    # SGLang streams the text and ids so far in every chunk
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, MAX_NEW + 1))
    assert chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert [c["meta_info"]["completion_tokens"] for c in chunks][-1] == MAX_NEW
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_openai_stream_ends_with_done(tiny_server):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    *events, done = tiny_server.post("/v1/completions", body).events()
    assert done == "[DONE]"
    usage = json.loads(events[-1])["usage"]
    assert usage["completion_tokens"] == 3
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_health_and_info(tiny_server):
    assert tiny_server.get("/health").status == 200
    assert tiny_server.get("/health_generate").status == 200
    server_info = tiny_server.get("/get_server_info").json()
    assert server_info["served_model_name"] == tiny_server.name
    assert server_info["engine_alive"] is True
    assert server_info["cache"]["max_total_tokens"] == 4096
    assert server_info["model"]["context_length"] == 128
    assert {"num_running", "num_waiting", "kv_usage", "cache_hit_rate"} <= set(server_info["stats"])
    model_info = tiny_server.get("/get_model_info").json()
    assert model_info["context_length"] == 128
    assert model_info["served_model_name"] == tiny_server.name
    assert model_info["is_generation"] is True


def test_flush_cache_forgets_cached_prefixes(tiny_server):
    prompt = "flushing forgets every cached prefix of this prompt"
    generate(tiny_server, text=prompt)
    assert generate(tiny_server, text=prompt)["meta_info"]["cached_tokens"] > 0
    tiny_server.wait_idle()
    reply = tiny_server.post("/flush_cache", b"")
    assert reply.status == 200 and reply.json()["success"] is True
    assert generate(tiny_server, text=prompt)["meta_info"]["cached_tokens"] == 0


def test_flush_cache_refuses_while_requests_run(tiny_server):
    body = {"text": PROMPT, "stream": True, "sampling_params": {**SAMPLING, "max_new_tokens": 110}}
    sock = _open_stream(tiny_server, body)
    try:
        err = assert_error_body(tiny_server.post("/flush_cache", b""), 409)
        assert err["code"] == "engine_busy"
    finally:
        sock.close()
    tiny_server.wait_idle()
    assert tiny_server.post("/flush_cache", b"").status == 200


def test_metrics_count_requests_tokens_and_latency(tiny_server):
    generate(tiny_server, text=PROMPT + " counted")  # the second run hits the cache
    before = metrics(tiny_server)
    out = generate(tiny_server, text=PROMPT + " counted")
    after = metrics(tiny_server)
    for name in METRICS:
        assert any(k.startswith(name) for k in after), name
    meta = out["meta_info"]
    assert after["radixserve_num_running_reqs"] == 0 and after["radixserve_engine_up"] == 1
    grew = {
        k: after[k] - before.get(k, 0)
        for k in ("radixserve_prompt_tokens_total", "radixserve_generation_tokens_total",
                  "radixserve_cached_tokens_total", "radixserve_e2e_request_latency_seconds_count",
                  "radixserve_time_to_first_token_seconds_count",
                  "radixserve_inter_token_latency_seconds_count")
    }  # fmt: skip
    assert grew == {
        "radixserve_prompt_tokens_total": meta["prompt_tokens"],
        "radixserve_generation_tokens_total": MAX_NEW,
        "radixserve_cached_tokens_total": meta["cached_tokens"],
        "radixserve_e2e_request_latency_seconds_count": 1,
        "radixserve_time_to_first_token_seconds_count": 1,
        "radixserve_inter_token_latency_seconds_count": MAX_NEW - 1,
    }
    assert out["meta_info"]["cached_tokens"] > 0
    assert 0 < after["radixserve_cache_hit_rate"] < 1
    # one step per token (the prefill samples the first); the runner's share within each step
    step = {k: after[f"radixserve_engine_{k}"] - before[f"radixserve_engine_{k}"]
            for k in ("steps", "step_seconds", "runner_seconds")}  # fmt: skip
    assert step["steps"] == MAX_NEW
    assert 0 < step["runner_seconds"] <= step["step_seconds"]


def _one_client(server: ServerProcess, i: int, prompt: str) -> list:
    """One of several kinds of request, by ``i``; returns what greedy decoding must repeat."""
    kind = i % 4
    if kind == 0:
        return generate(server, text=prompt)["output_ids"]
    if kind == 1:
        reply = server.post("/generate", {"text": prompt, "stream": True,
                            "sampling_params": SAMPLING})  # fmt: skip
        *chunks, done = reply.events()
        assert done == "[DONE]"
        return json.loads(chunks[-1])["output_ids"]
    body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    if kind == 2:
        out = server.post("/v1/completions", body).json()
        return [out["choices"][0]["text"], out["usage"]["completion_tokens"]]
    events = server.post("/v1/completions", {**body, "stream": True}).events()
    assert events[-1] == "[DONE]"
    return ["".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]), MAX_NEW]


def test_32_concurrent_clients_get_what_they_get_alone(tiny_server):
    prompts = [f"client {i} asks about {'fox dog paris rome'.split()[i % 4]} " * (1 + i % 3)
               for i in range(32)]  # fmt: skip
    tiny_server.post("/flush_cache", b"")
    alone = [_one_client(tiny_server, i, p) for i, p in enumerate(prompts)]
    tiny_server.post("/flush_cache", b"")
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda a: _one_client(tiny_server, *a), enumerate(prompts)))
    assert together == alone
    assert tiny_server.wait_idle()["kv_usage"] == 0.0


def _open_stream(server: ServerProcess, body: dict) -> socket.socket:
    """Send a request by hand and return the socket once the first bytes of the answer came."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=30)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    return sock


def _assert_nothing_held(server: ServerProcess, aborted_before: int) -> None:
    st = server.wait_idle()
    assert st["num_aborted"] > aborted_before, st  # aborted, not run to the end
    assert st["kv_usage"] == 0.0, st  # every slot is free or evictable cache
    m = metrics(server)
    assert m["radixserve_num_running_reqs"] == 0 and m["radixserve_token_usage"] == 0
    assert m['radixserve_requests_total{finish_reason="abort"}'] >= 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_frees_its_kv(tiny_server, stream):
    log_mark = len(tiny_server.lines)
    aborted = tiny_server.stats()["num_aborted"]
    body = {"text": PROMPT, "stream": stream,
            "sampling_params": {**SAMPLING, "max_new_tokens": 110}}  # fmt: skip
    if stream:
        sock = _open_stream(tiny_server, body)
    else:
        data = json.dumps(body).encode()
        sock = socket.create_connection((tiny_server.host, tiny_server.port), timeout=30)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(data), data))  # fmt: skip
        deadline = time.monotonic() + 10
        while tiny_server.stats()["num_running"] == 0:  # wait until it runs
            assert time.monotonic() < deadline
            time.sleep(0.01)
    sock.close()
    _assert_nothing_held(tiny_server, aborted)
    assert generate(tiny_server, text=PROMPT)["meta_info"]["completion_tokens"] == MAX_NEW
    assert not tiny_server.errors(log_mark)  # a client leaving is no server error


def _leave(server: ServerProcess, i: int) -> None:
    """Send a long request and leave at once (body still unread, or prefilling), or, for a
    stream, after its first bytes."""
    stream = i % 2 == 0
    body = json.dumps({"text": f"client {i} leaves", "stream": stream,
                       "sampling_params": {**SAMPLING, "max_new_tokens": 100}}).encode()  # fmt: skip
    sock = socket.create_connection((server.host, server.port), timeout=30)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))  # fmt: skip
    if stream:
        sock.recv(100)
    sock.close()


def test_many_clients_leaving_at_once_leave_nothing_behind(tiny_server):
    log_mark = len(tiny_server.lines)
    with ThreadPoolExecutor(24) as pool:
        list(pool.map(lambda i: _leave(tiny_server, i), range(24)))
    st = tiny_server.wait_idle()
    assert st["kv_usage"] == 0.0, st
    assert not tiny_server.errors(log_mark)
    assert generate(tiny_server, text=PROMPT)["meta_info"]["completion_tokens"] == MAX_NEW


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_rid_utf8_cannot_carry_comes_back_escaped(tiny_server, stream):
    rid = f"lone-\ud800-surrogate-{stream}"  # valid JSON ("\ud800"), but no UTF-8 for it
    reply = tiny_server.post("/generate", {"text": "a", "rid": rid, "stream": stream,
                             "sampling_params": SAMPLING})  # fmt: skip
    assert reply.status == 200, reply.body
    last = json.loads(reply.events()[-2]) if stream else reply.json()
    assert last["meta_info"]["id"] == rid


def test_cache_salt_keeps_prefixes_apart(tiny_server):
    text = "a radix tree shares the prefixes of many prompts and the quick brown fox"
    first = generate(tiny_server, text=text, cache_salt="tenant-a")["meta_info"]
    again = generate(tiny_server, text=text, cache_salt="tenant-a")["meta_info"]
    other = generate(tiny_server, text=text, cache_salt="tenant-b")["meta_info"]
    assert first["cached_tokens"] == 0
    assert again["cached_tokens"] >= again["prompt_tokens"] - 1  # the same salt reuses it all
    assert other["cached_tokens"] == 0  # another salt never sees tenant a's KV
    reply = tiny_server.post("/v1/completions", {"prompt": text, "lora_path": "adapter-1"})
    assert reply.status == 400 and reply.json()["error"]["param"] == "lora_path"
