"""The cache, scheduler, router policies and simulator must run where torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys

PURE = [
    "radixserve.cache.radix",
    "radixserve.cache.pool",
    "radixserve.cache.hashing",
    "radixserve.config",
    "radixserve.sched.request",
    "radixserve.sched.batch",
    "radixserve.sched.scheduler",
    "radixserve.sched.policy",
    "radixserve.sched.adder",
    "radixserve.router.tree",
    "radixserve.router.policies",
    "radixserve.router.app",
    "radixserve.router.cli",
    "radixserve.sim.costmodel",
    "radixserve.sim.runner",
    "radixserve.sim.workloads",
    "radixserve.sim.cluster",
    "radixserve.bench.loadgen",
    "radixserve.bench.cli",
    "radixserve.sim.cli",
    # the engine and server plumbing too: `radixserve serve --sim` runs without torch
    "radixserve.engine.engine",
    "radixserve.engine.scheduler_proc",
    "radixserve.server.app",
]
OPTIONAL: list[str] = []

BLOCK_TORCH = """
import importlib.abc, importlib.util, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import importlib
for mod in sys.argv[1:]:
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:  # its package does not exist yet
        found = False
    if found:
        importlib.import_module(mod)
assert "torch" not in sys.modules
print("ok")
"""


def test_pure_parts_import_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, *PURE, *OPTIONAL], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
