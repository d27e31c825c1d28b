"""`radixserve serve --sim tiny-cpu`: the same server, scheduler and cache on the simulated runner
(no torch needed); the endpoints answer, and an idle worker uses next to no CPU."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from server_harness import ServerProcess, assert_error_body, cpu_seconds

SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
IDLE_CPU_S = 0.2  # CPU seconds the whole process tree may use in 2 s idle


@pytest.fixture(scope="module")
def sim_server():
    server = ServerProcess(["--sim", "tiny-cpu"])
    yield server
    server.stop()


def test_the_endpoints_answer(sim_server):
    for path in ("/health", "/health_generate", "/get_server_info", "/get_model_info",
                 "/v1/models", "/metrics"):  # fmt: skip
        assert sim_server.get(path).status == 200, path
    assert sim_server.get("/v1/models").json()["data"][0]["id"] == sim_server.name
    assert sim_server.get("/get_model_info").json()["model_path"] == "sim:tiny-cpu"
    text = sim_server.post("/generate", {"text": "hello there", "sampling_params": SAMPLING})
    assert text.json()["meta_info"]["completion_tokens"] == 6
    ids = sim_server.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": SAMPLING})
    assert len(ids.json()["output_ids"]) == 6
    stream = sim_server.post("/generate", {"text": "hello", "stream": True,
                             "sampling_params": SAMPLING})  # fmt: skip
    assert stream.events()[-1] == "[DONE]"
    chat = sim_server.post("/v1/chat/completions", {"max_tokens": 3, "messages":
                           [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert chat.json()["usage"]["completion_tokens"] == 3
    assert sim_server.post("/flush_cache", b"").json()["success"] is True
    assert_error_body(sim_server.post("/v1/completions", {"prompt": "a", "model": "x"}), 404)


def test_openai_client_streams_with_usage(sim_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=sim_server.url + "/v1", api_key="-", max_retries=0)
    kw = {"model": sim_server.name, "prompt": "the same prompt twice " * 4, "max_tokens": 4}
    client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))  # fmt: skip
    usage = chunks[-1].usage
    assert usage.completion_tokens == 4
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_an_idle_sim_server_uses_next_to_no_cpu(sim_server):
    sim_server.post("/generate", {"text": "warm up", "sampling_params": SAMPLING})
    sim_server.wait_idle()
    time.sleep(0.3)  # let the last answer's bookkeeping finish
    tree = sim_server.tree()
    assert len(tree) >= 3  # the server, the scheduler and the detokenizer at least
    before = cpu_seconds(tree)
    time.sleep(2.0)
    used = cpu_seconds(tree) - before
    assert used < IDLE_CPU_S, f"{used:.2f} CPU seconds in 2 s idle by {tree}"


def test_any_text_is_a_prompt_in_the_vocabulary(sim_server):
    """Words that read as rendered token ids past the vocabulary ("hide" = hi + de, longer ones
    much larger) are hashed into range like any other word, never refused (issue 17, point 2)."""
    from radixserve.sim.workloads import parse_text

    rng = random.Random(17)
    texts: list[str] = []
    while len(texts) < 6:  # random strings; keep those with such a word (about 1 in 130)
        text = "".join(rng.choice("abcdefghij ") for _ in range(100))
        if any(_reads_as_id(parse_text, w) >= 32000 for w in text.split()):
            texts.append(text)
    for text in texts + ["a plain prompt", "hide the deadhead"]:
        reply = sim_server.post("/generate", {"text": text, "sampling_params": SAMPLING})
        assert reply.status == 200, (text, reply.body)


def _reads_as_id(parse_text, word: str) -> int:
    try:
        return parse_text(word)[0]
    except ValueError:
        return -1


def test_bench_replays_the_mooncake_trace_against_a_sim_worker(sim_server, tmp_path):
    """Trace token ids fit the worker's 32k vocabulary, so every request is served, and the
    worker's own hit rate is what the trace implies (issue 17, point 1; before, every request
    was refused: "input_ids must be token ids in [0, 32000)")."""
    pytest.importorskip("httpx")
    from radixserve.cli import main

    # the trace's requests that start with its most shared block (ids past 43,000): a run of
    # 24 with real sharing, where the trace's first 24 share nothing
    rows = [json.loads(line) for line in (Path(__file__).parents[2] / "traces" /
            "mooncake_synthetic_trace.jsonl").read_text().splitlines()]  # fmt: skip
    first = Counter(r["hash_ids"][0] for r in rows).most_common(1)[0][0]
    trace = tmp_path / "shared.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows if r["hash_ids"][0] == first))
    out = tmp_path / "bench.json"
    assert sim_server.post("/flush_cache", b"").json()["success"] is True
    argv = ["bench", "--base-url", sim_server.url, "--workload", "trace", "--trace", str(trace),
            "--limit", "24", "--block-tokens", "16", "--max-concurrency", "1", "--no-progress",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["failed"] == 0, doc["summary"]["errors"]
    assert doc["best_hit_rate"] > 0.2
    assert doc["summary"]["cache_hit_rate"] == pytest.approx(doc["best_hit_rate"], abs=0.01)


def test_a_sim_server_loads_no_torch(sim_server):
    """Many simulated workers share one machine: none of their processes maps torch."""
    for pid in sim_server.tree():
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read(), pid


def test_a_higher_priority_request_overtakes_a_queued_one():
    """With priority scheduling and one running slot, a request queued later with a higher
    ``priority`` finishes before an earlier one (SGLang's field names, in both APIs)."""
    server = ServerProcess(["--sim", "llama3-8b-h100", "--enable-priority-scheduling",
                            "--max-running-requests", "1"])  # fmt: skip
    try:
        done: list[str] = []

        def send(name: str, path: str, body: dict) -> None:
            reply = server.post(path, body)
            assert reply.status == 200, reply.body
            done.append(name)

        blocker = {"text": "hold", "sampling_params": {**SAMPLING, "max_new_tokens": 300}}
        low = {"text": "low", "priority": 0, "routing_key": "a", "sampling_params": SAMPLING}
        high = {"prompt": "high", "max_tokens": 6, "priority": 5, "routing_key": "b"}
        threads = [
            threading.Thread(target=send, args=("blocker", "/generate", blocker)),
            threading.Thread(target=send, args=("low", "/generate", low)),
            threading.Thread(target=send, args=("high", "/v1/completions", high)),
        ]
        for t in threads:  # one at a time, so that they arrive in this order
            t.start()
            time.sleep(0.3)
        for t in threads:
            t.join(30)
        assert done == ["blocker", "high", "low"]
        bad = server.post("/generate", {"text": "x", "priority": "high"})
        assert_error_body(bad, 400)
    finally:
        server.stop()


def test_sim_vocab_size_sets_the_simulated_vocabulary(capsys):
    """`serve --sim --sim-vocab-size N`: ids in [0, N) are served, N is refused by name; the
    flag without --sim is refused, not ignored (issue 17, point 1)."""
    from radixserve.cli import main

    server = ServerProcess(["--sim", "tiny-cpu", "--sim-vocab-size", "100000"])
    try:
        ok = server.post("/generate", {"input_ids": [99_999, 40_000], "sampling_params": SAMPLING})
        assert ok.status == 200, ok.body
        bad = server.post("/generate", {"input_ids": [100_000], "sampling_params": SAMPLING})
        assert_error_body(bad, 400)
        assert "[0, 100000)" in bad.json()["error"]["message"]
    finally:
        server.stop()
    assert main(["serve", "--sim-vocab-size", "5000"]) == 2
    assert "--sim-vocab-size needs --sim" in capsys.readouterr().err


def test_an_unknown_sim_preset_is_one_line(capsys):
    """`serve --sim NAME` with no such preset: exit 2 with the known names, before any process
    starts (it used to print the scheduler process's traceback)."""
    from radixserve.cli import main

    assert main(["serve", "--sim", "no-such-gpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown cost model 'no-such-gpu'" in err and "tiny-cpu" in err
    assert "Traceback" not in err
