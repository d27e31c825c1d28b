"""The router's /metrics families for kv_aware's index: device blocks per worker, and blocks on a
lower medium (KV events' `medium`, e.g. a host tier's "CPU") per worker and medium."""

from __future__ import annotations

from radixserve.router.kvindex.event_format import BlockRemoved, BlockStored
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.kv_aware import KvAwarePolicy
from radixserve.router.proxy.kv_setup import KvRouting
from radixserve.router.proxy.metrics import _kv_families

PROMPT = tuple(range(100, 124))  # 6 blocks of 4


def samples(routing: KvRouting, name: str) -> dict[tuple[str, ...], float]:
    urls = {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}
    fams = {f.name: f for f in _kv_families(routing.metric_families(), urls)}
    fam = fams["radixserve_router_" + name]
    return {tuple(s.labels.values()): s.value for s in fam.samples}


def test_lower_medium_blocks_are_a_gauge_per_worker_and_medium():
    policy = KvAwarePolicy(CachePolicyConfig(cache_aware_scheduling_min_tokens=0))
    routing = KvRouting(policy, subscribe=False)
    index = policy.index
    index.apply("a", [BlockStored((1, 2, 3), None, PROMPT[:12], 4, "", "GPU")])
    index.apply("b", [BlockStored((7,), None, PROMPT[:4], 4, "", "GPU")])
    assert samples(routing, "kv_index_lower_blocks") == {}  # nothing below the device yet
    index.apply("a", [BlockStored((1, 2, 3), None, PROMPT[:12], 4, "", "CPU")])
    index.apply("a", [BlockRemoved((2, 3), "GPU")])  # evicted from device, kept on the host
    assert samples(routing, "kv_index_lower_blocks") == {("http://127.0.0.1:1", "CPU"): 3.0}
    assert samples(routing, "kv_index_blocks") == {
        ("http://127.0.0.1:1",): 1.0,
        ("http://127.0.0.1:2",): 1.0,
    }
    # two device blocks removed on a: counted per worker, as operators ask "is it evicting?"
    assert samples(routing, "kv_index_removed_blocks") == {
        ("http://127.0.0.1:1",): 2.0,
        ("http://127.0.0.1:2",): 0.0,
    }
    index.apply("a", [BlockRemoved((3,), "CPU")])  # the host tier dropped one
    assert samples(routing, "kv_index_lower_blocks") == {("http://127.0.0.1:1", "CPU"): 2.0}
