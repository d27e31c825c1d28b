"""`radixserve bench` against the fake worker: every request completes and is timed, the three
wire formats work, closed loop keeps its concurrency, chat turns wait for their reply, failures
are counted, and the cached tokens a server reports are read from either format."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from fake_worker import spawn  # noqa: E402
from radixserve.bench.backends import BACKENDS, OpenAIChat, OpenAICompletions, SGLangGenerate  # noqa: E402
from radixserve.bench.loadgen import LoadConfig, RequestRecord, run_load  # noqa: E402
from radixserve.bench.report import summarize  # noqa: E402
from radixserve.cli import main  # noqa: E402
from radixserve.sim.workloads import (  # noqa: E402
    MultiTurnConfig,
    SharedPrefixConfig,
    generated_shared_prefix,
    multi_turn_chat,
)


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    proc, url = spawn("--token-delay-ms", "1")
    try:
        yield url
    finally:
        proc.kill()
        proc.wait()


def small(**kw: object) -> list[str]:
    flags = {"--num-groups": 2, "--prompts-per-group": 4, "--system-prompt-len": 64}
    flags.update({"--output-len": 5, **kw})  # type: ignore[dict-item]
    return [str(x) for kv in flags.items() for x in kv] + ["--no-progress"]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_request_completes_and_is_timed(
    worker: str, backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--base-url", worker, "--backend", backend, "--json", str(out)]
    assert main(argv + small(**{"--request-rate": 500})) == 0
    text = capsys.readouterr().out
    assert "8/8 completed, 0 failed" in text and "TTFT" in text and "ITL" in text
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["output_tokens"] == 8 * 5  # the fake worker streams one event per token
    assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"] and s["itl_ms"]["p50"] >= 0
    assert s["cache_hit_rate"] is None  # the fake worker reports no cached tokens
    assert all(len(r["itl"]) == 4 for r in doc["requests"])
    if backend.startswith("openai"):  # the name OpenAI servers check comes from /v1/models
        assert doc["target"]["model"] == "fake-model"


def test_closed_loop_keeps_at_most_n_requests_in_flight(worker: str) -> None:
    reqs = generated_shared_prefix(
        SharedPrefixConfig(num_groups=4, prompts_per_group=6, system_prompt_len=32, output_len=4)
    )
    cfg = LoadConfig(worker, OpenAICompletions(), max_concurrency=3, progress=False)
    records = asyncio.run(run_load(reqs, cfg))
    assert all(r.ok for r in records)
    spans = [(r.sent, r.sent + (r.e2e or 0)) for r in records]
    peak = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert peak <= 3


def test_chat_turns_are_sent_after_the_previous_answer(worker: str) -> None:
    cfg = MultiTurnConfig(num_sessions=3, turns=3, system_prompt_len=32, output_len=4)
    reqs = multi_turn_chat(dataclasses.replace(cfg, think_time_s=0.01))
    records = asyncio.run(run_load(reqs, LoadConfig(worker, OpenAIChat(), progress=False)))
    by_rid = {r.rid: r for r in records}
    for req in reqs:
        if req.prev_rid is not None:
            prev = by_rid[req.prev_rid]
            assert by_rid[req.rid].sent >= prev.sent + (prev.e2e or 0) + 0.01


def test_failures_are_counted_not_raised(worker: str, capsys: pytest.CaptureFixture[str]) -> None:
    body = json.dumps({"count": 2, "status": 503}).encode()
    urllib.request.urlopen(urllib.request.Request(f"{worker}/fake/fail", body, method="POST"))
    argv = ["bench", "--base-url", worker, "--max-concurrency", "1"]
    assert main(argv + small()) == 1
    assert "6/8 completed, 2 failed" in capsys.readouterr().out


def test_unreachable_server_fails_every_request(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--base-url", "http://127.0.0.1:9", "--max-concurrency", "2"]
    assert main(argv + small()) == 1
    assert "0/8 completed, 8 failed" in capsys.readouterr().out


def test_a_base_url_without_a_scheme_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--base-url", "127.0.0.1:8000", *small()]) == 2
    err = capsys.readouterr().err
    assert "--base-url must be an http:// or https:// URL" in err and "Traceback" not in err


def test_cached_tokens_are_read_from_openai_usage_and_sglang_meta_info() -> None:
    usage = {"prompt_tokens": 100, "completion_tokens": 5}
    usage["prompt_tokens_details"] = {"cached_tokens": 64}  # type: ignore[assignment]
    ev = OpenAICompletions().parse({"choices": [], "usage": usage})
    assert (ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens) == (100, 64, 5)
    meta = {"prompt_tokens": 80, "cached_tokens": 40, "finish_reason": {"type": "length"}}
    ev = SGLangGenerate().parse({"text": "a b", "meta_info": meta})
    assert (ev.prompt_tokens, ev.cached_tokens, ev.done) == (80, 40, True)


def test_summary_reports_the_servers_hit_rate() -> None:
    recs = [
        RequestRecord("a", 10, 0.0, 0.1, 0.5, [0.1], 4, prompt_tokens=100, cached_tokens=0),
        RequestRecord("b", 10, 0.2, 0.1, 0.5, [0.1], 4, prompt_tokens=100, cached_tokens=80),
    ]
    s = summarize(recs)
    assert s["cache_hit_rate"] == pytest.approx(0.4)
    assert s["duration_s"] == pytest.approx(0.7)
    assert s["output_throughput"] == pytest.approx(8 / 0.7)


def test_a_failed_run_reports_its_real_duration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that accepts connections and never answers: every request times out after
    0.5 s, two at a time, so the run takes about 2 s; the summary says so (issue 17, point 6)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        out = tmp_path / "bench.json"
        argv = ["bench", "--base-url", url, "--timeout-s", "0.5", "--max-concurrency", "2"]
        assert main(argv + ["--json", str(out)] + small()) == 1
    text = capsys.readouterr().out
    assert "0/8 completed, 8 failed" in text
    s = json.loads(out.read_text())["summary"]
    assert s["duration_s"] >= 4 * 0.5 and s["request_throughput"] == 0.0
    assert f"duration: {s['duration_s']:.2f} s; 0.00 req/s" in text


def test_failed_requests_count_in_the_duration() -> None:
    recs = [
        RequestRecord("ok", 10, 0.0, 0.1, 0.5, [], 4),
        RequestRecord("late", 10, 0.2, error="ReadTimeout", ended=165.0),
    ]
    s = summarize(recs)
    assert s["duration_s"] == pytest.approx(165.0)
    assert s["request_throughput"] == pytest.approx(1 / 165.0)
