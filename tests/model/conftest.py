"""The CPU kernels built once per test module into a temporary directory (the kernel tests'
shared fixture)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    pytest.importorskip("torch")
    from radixserve.model import kernels

    k = kernels.load_cpu_kernels(tmp_path_factory.mktemp("kernels"))
    assert isinstance(k, kernels.CpuKernels), k
    return k
