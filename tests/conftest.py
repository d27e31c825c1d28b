"""Fixtures shared by several test modules: one tiny-model HTTP server for every
tests/test_server_*.py module (starting one costs seconds on a small machine), the path of
Mooncake's trace, and the CPU kernels built per module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# engines the tests start run one torch thread each (before torch is imported here): several
# engine processes and the test client share this machine's cores, and torch threads that share
# a core stall each other (the default, one per core, is for a machine the engine has to itself)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from server_harness import TINY_SERVER_ARGS, ServerProcess


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama HF directory with a chat template and a tokenizer."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_model

    return build_tiny_model("llama3", tmp_path_factory.mktemp("tiny-server"))


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    """`radixserve serve` on the tiny model; stopped (no orphans) at the end."""
    server = ServerProcess(["--model", str(tiny_model_dir), *TINY_SERVER_ARGS])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    """Mooncake's synthetic trace, as committed under traces/."""
    path = Path(__file__).parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"
    assert path.exists(), f"{path} is part of the repository"
    return path


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The CPU kernels built once per test module into a temporary directory."""
    pytest.importorskip("torch")
    from radixserve.model import kernels

    k = kernels.load_cpu_kernels(tmp_path_factory.mktemp("kernels"))
    assert isinstance(k, kernels.CpuKernels), k
    return k
