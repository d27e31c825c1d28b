"""Fixtures shared by several test modules: one tiny-model HTTP server for every
tests/test_server_*.py module (starting one costs seconds on a small machine)."""

from __future__ import annotations

import pytest

from server_harness import ServerProcess

# small limits, so that the refusals they cause are cheap to reach
TINY_SERVER_ARGS = ("--max-total-tokens", "4096", "--context-length", "128",
                    "--max-payload-size", "65536", "--max-batch-size", "8")  # fmt: skip


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """`radixserve serve` on a tiny random-weight Llama; stopped (no orphans) at the end."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_model

    model_dir = build_tiny_model("llama3", tmp_path_factory.mktemp("tiny-server"))
    server = ServerProcess(["--model", str(model_dir), *TINY_SERVER_ARGS])
    yield server
    server.stop()
