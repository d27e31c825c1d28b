"""`radixserve sim --radix-eviction-policy A B ...` runs one simulation per policy, each with
that policy in every engine's radix cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main


def test_sim_compares_eviction_policies(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    argv = [
        "sim", "--workload", "multi-turn", "--num-sessions", "24", "--turns", "4",
        "--request-rate", "4", "--system-prompt-len", "128", "--user-len", "64",
        "--output-len", "8", "--engines", "1", "--router", "round_robin",
        "--max-total-tokens", "1500", "--radix-eviction-policy", "lru", "mru",
        "--json", str(out), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "mru vs lru" in text
    results = {r["label"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"lru", "mru"}
    assert all(r["num_finished"] == 96 for r in results.values())
    # the pool holds a fraction of the histories, so the policy decides what is reused: here
    # the sessions cycle through it and MRU keeps some whole where LRU keeps none to the end
    assert results["mru"]["hit_rate"] > results["lru"]["hit_rate"] + 0.05
