"""`radixserve sim` on the Mooncake trace says what it did: no requests or a KV pool too small
end in a clear message, rejected requests are counted with their reason and leave the best hit
rate as they leave the hit rate, and the JSON records the policies that actually ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main


def sim(trace: Path, *flags: str) -> list[str]:
    return ["sim", "--workload", "trace", "--trace", str(trace), "--no-progress", *flags]


def test_no_requests_is_a_one_line_error(
    mooncake_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(sim(mooncake_trace, "--limit", "0")) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "radixserve sim: error: nothing to simulate: the trace workload has no requests"
    )


def test_a_pool_too_small_for_every_request_is_reported_not_a_traceback(
    mooncake_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(sim(mooncake_trace, "--limit", "50", "--max-total-tokens", "100")) == 1
    out = capsys.readouterr().out
    assert "1/50" in out  # one prompt of the 50 (plus its output) fits 100 tokens
    assert "warning: cache_aware: 49 of 50 requests rejected (49 x prompt + max_new_tokens " in out
    assert "needs more KV slots than the pool holds (100))" in out
    # none fits: nothing finished, still a table and a warning
    assert main(sim(mooncake_trace, "--limit", "1", "--max-total-tokens", "16")) == 1
    assert "0/1" in capsys.readouterr().out


def test_rejected_requests_leave_the_best_hit_rate_too(
    mooncake_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    flags = ["--limit", "200", "--max-total-tokens", "20000", "--page-size", "16"]
    assert main(sim(mooncake_trace, *flags, "--json", str(out))) == 1
    text = capsys.readouterr().out
    (res,) = json.loads(out.read_text())["results"]
    assert 0 < res["num_rejected"] < 200 and res["num_finished"] == 200 - res["num_rejected"]
    assert res["hit_rate"] <= res["best_hit_rate"]
    assert f"hit and best count the {res['num_finished']} served requests only" in text


def test_json_records_the_router_and_schedule_policy_that_ran(
    mooncake_trace: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sim.json"
    flags = ["--limit", "40", "--block-tokens", "16", "--engines", "2", "--json", str(out)]
    assert (
        main(sim(mooncake_trace, *flags, "--router", "round_robin", "--schedule-policy", "fcfs"))
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["cluster"]["router"] == "round_robin"
    assert doc["scheduler"]["schedule_policy"] == "fcfs"
    assert (doc["results"][0]["router"], doc["results"][0]["schedule_policy"]) == (
        "round_robin",
        "fcfs",
    )
    assert main(sim(mooncake_trace, *flags, "--router", "random", "cache_aware")) == 0
    doc = json.loads(out.read_text())
    assert doc["cluster"]["router"] == ["random", "cache_aware"]
    assert [r["router"] for r in doc["results"]] == ["random", "cache_aware"]
    assert doc["scheduler"]["schedule_policy"] == "lpm"
