"""kv_aware's tier-aware score as a pure policy (issue 28 item 2): device holdings from an
in-memory event index, lower-tier holdings from an in-memory TierSource fake; the store keys a
router computes equal the engines' page_keys; `route`'s Mooncake flags."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from radixserve.cache.hashing import KVNamespace, page_keys
from radixserve.config import add_dataclass_args, from_args
from radixserve.router.kvindex.event_format import BlockRemoved, BlockStored
from radixserve.router.kvindex.mooncake_meta import KeyLocation, Replica, store_keys
from radixserve.router.kvindex.mooncake_reader import MooncakeIndexConfig, MooncakeStoreReader
from radixserve.router.kvindex.tiers import FixedTier
from radixserve.router.policies.base import RequestView, WorkerView
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.kv_aware import KvAwarePolicy
from radixserve.router.policies.prefill_work import DEFAULT_LOAD_RATIO, prefill_work
from radixserve.router.proxy.config import RouterConfig
from radixserve.router.proxy.kv_setup import hash_seed, open_kv_index

BS = 16
PROMPT = list(range(5000, 5000 + 64 * BS))  # 1,024 tokens


def view(ids):
    return RequestView.from_prompt(input_ids=ids)


def hold(policy, worker, ids):
    n = len(ids) // BS
    policy.index.apply(worker, [BlockStored(tuple(range(n)), None, tuple(ids[: n * BS]), BS, "")])


def policy_with(store):
    return KvAwarePolicy(CachePolicyConfig(cache_aware_scheduling_min_tokens=0), lower=(store,))


def test_prefill_work_prices_each_tier():
    assert prefill_work(1000, 1000, 0, None) == 0  # on device: free
    assert prefill_work(1000, 0, 0, None) == 1000  # nowhere: all computed
    assert prefill_work(1000, 0, 1000, 0.2) == pytest.approx(200)  # loaded at 0.2 per token
    assert prefill_work(1000, 400, 1000, 0.5) == pytest.approx(300)  # device 400, load 600
    assert prefill_work(1000, 0, 800, None) == pytest.approx(200 + DEFAULT_LOAD_RATIO * 800)
    assert prefill_work(1000, 600, 300, 0.5) == 400  # a shorter lower-tier hit adds nothing


def test_device_holder_wins_over_a_worker_that_must_load():
    store = FixedTier({"w0": len(PROMPT), "w1": len(PROMPT), "w2": len(PROMPT)})
    policy = policy_with(store)
    hold(policy, "w1", PROMPT)
    workers = [WorkerView(f"w{i}") for i in range(3)]
    assert policy.select(workers, view(PROMPT), 0.0) == 1


def test_store_hit_beats_recompute_on_a_less_loaded_worker():
    # w0 holds the prefix on device but has 2,000 prefill tokens queued; w1 can load it from the
    # store at 0.1 per token (~100 tokens of work); w2 holds nothing anywhere
    store = FixedTier({"w1": len(PROMPT)})
    policy = policy_with(store)
    hold(policy, "w0", PROMPT)
    busy = [WorkerView("w0", prefill_tokens=8000, reported_at=0.0), WorkerView("w1"),
            WorkerView("w2")]  # fmt: skip
    assert policy.select(busy, view(PROMPT), 1.0) == 1
    # without the store answer (down) w1 and w2 both recompute: no reason to prefer w1
    assert policy_with(FixedTier(None)).cached_tokens(busy, view(PROMPT)).get("w1", 0) == 0


def test_reported_ratio_decides_who_loads():
    # both can load the whole prompt; w0 loads as slowly as it prefills, w1 at 5%
    store = FixedTier({"w0": len(PROMPT), "w1": len(PROMPT)})
    policy = policy_with(store)
    workers = [WorkerView("w0", kv_load_ratio=1.0), WorkerView("w1", kv_load_ratio=0.05)]
    assert policy.select(workers, view(PROMPT), 0.0) == 1
    workers = [WorkerView("w0", kv_load_ratio=0.05), WorkerView("w1", kv_load_ratio=1.0)]
    assert policy.select(workers, view(PROMPT), 0.0) == 0


def test_loaded_tokens_are_not_counted_as_queued_prefill():
    store = FixedTier({"w0": len(PROMPT)})
    policy = policy_with(store)
    workers = [WorkerView("w0"), WorkerView("w1")]
    req = view(PROMPT)
    assert policy.select(workers, req, 0.0) == 0
    policy.on_dispatch("w0", req, 0.0)
    assert policy.pending(workers[0]) == 0 and policy.loaded_tokens == len(PROMPT)


def test_a_source_that_cannot_answer_counts_for_no_worker():
    policy = policy_with(FixedTier(None))
    hold(policy, "w1", PROMPT)
    workers = [WorkerView("w0"), WorkerView("w1")]
    assert policy.select(workers, view(PROMPT), 0.0) == 1
    assert policy.loadable_tokens(workers, [0, 1], view(PROMPT), len(PROMPT)) == {}


# ----- the store's keys, as the engines write them ------------------------------------------------


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256_hex", "xxhash"])
def test_router_store_keys_equal_the_engines_page_keys(algo):
    ns = KVNamespace("sim:h100-llama8b", "bfloat16", 32, 8, 128, 16)
    ids = list(range(3000, 3000 + 1000))
    ours = store_keys(ids, ns.digest(), 256, algo, 7)
    assert ours == page_keys(ids, ns, 256, algo, 7) and len(ours) == 3
    assert len(store_keys(ids, ns.digest(), 256, algo, 7, partial=True)) == 4


def _reader(**kw):
    return MooncakeStoreReader(MooncakeIndexConfig("127.0.0.1:9", chunk_size=256, **kw))


def test_reader_maps_replicas_to_workers(monkeypatch):
    """Own segment -> that worker; a segment no worker claims (the store process) -> all."""
    reader = _reader()
    ns = "rkv1-0123456789abcdef"
    assert reader.register("a", {"kv_store": {"namespace": ns, "segment": "127.0.0.1:2001"}})
    assert reader.register("b", {"kv_store": {"namespace": ns, "segment": None}})
    assert reader.register("c", {"kv_store": {"namespace": ns, "chunk_size": 256}})
    assert not reader.register("d", {"kv_store": {"namespace": ns, "chunk_size": 64}})
    assert not reader.register("e", {"version": "x"})  # writes no store keys
    ids = list(range(4 * 256 + 10))

    def rep(endpoint):
        return KeyLocation(True, (Replica(endpoint, "memory", 64),))

    answers = [rep("127.0.0.1:2001"), rep("127.0.0.1:2001"), rep("127.0.0.1:7000"),
               KeyLocation(False, (), "OBJECT_NOT_FOUND")]  # fmt: skip
    asked = []

    async def aquery(keys):
        asked.append(list(keys))
        return answers[: len(keys)]

    monkeypatch.setattr(reader.client, "aquery", aquery)
    asyncio.run(reader.prepare(ids))
    assert asked == [store_keys(ids, ns, 256)]  # one query, whole chunks only
    # a: its own two chunks, then the store process's third; b and c: the store's first chunk
    # is on a's segment, so they hold nothing contiguous from the start
    assert reader.loadable_tokens(["a", "b", "c", "d"]) == {"a": 3 * 256}

    answers[:2] = [rep("127.0.0.1:7000"), rep("127.0.0.1:7000")]
    asyncio.run(reader.prepare(ids))
    assert reader.loadable_tokens(["a", "b", "c"]) == {"a": 768, "b": 768, "c": 768}

    async def down(keys):
        return None

    monkeypatch.setattr(reader.client, "aquery", down)
    asyncio.run(reader.prepare(ids))
    assert reader.loadable_tokens(["a"]) is None


def test_reader_skips_short_prompts_without_asking(monkeypatch):
    reader = _reader(min_tokens=1024)
    reader.register("a", {"kv_store": {"namespace": "rkv1-x", "segment": None}})

    async def aquery(keys):
        raise AssertionError("asked")

    monkeypatch.setattr(reader.client, "aquery", aquery)
    asyncio.run(reader.prepare(list(range(1000))))
    assert reader.loadable_tokens(["a"]) == {} and reader.skipped == 1


# ----- `route`'s flags ----------------------------------------------------------------------------


def route_config(*argv):
    parser = argparse.ArgumentParser(exit_on_error=False)  # a bad value raises, not exits
    add_dataclass_args(parser, RouterConfig, "router")
    return from_args(RouterConfig, parser.parse_args(list(argv)))


def test_llumnix_flag_names_build_a_mooncake_reader(monkeypatch):
    monkeypatch.setenv("GO_HASH_SEED", "42")
    cfg = route_config(
        "--policy", "kv_aware", "--kv-index", "mooncake://127.0.0.1:8123",
        "--kvs-backend", "mooncake", "--kvs-hash-algo", "xxhash", "--kvs-chunk-size", "128",
        "--kvs-enable-save-unfull-chunk", "--kvs-retry-times", "2",
        "--kvs-retry-interval-ms", "10", "--kvs-metadata-service-down-duration-s", "3",
        "--cache-aware-scheduling-min-tokens", "1024",
    )  # fmt: skip
    reader, policy = open_kv_index(cfg, lambda url: None)
    assert isinstance(reader, MooncakeStoreReader) and policy.lower[-1] is reader
    mc = reader.config
    assert (mc.address, mc.hash_algo, mc.chunk_size, mc.seed, mc.save_unfull_chunk) == (
        "127.0.0.1:8123", "xxhash", 128, 42, True)  # fmt: skip
    assert (mc.retry_times, mc.retry_interval_ms, mc.down_duration_s, mc.min_tokens) == (
        2, 10, 3, 1024)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--kv-index", "mooncake://127.0.0.1:8123"], "kv_aware only"),
        (["--policy", "kv_aware", "--kv-index", "mooncake://nohost"], "HOST:PORT"),
        (["--policy", "kv_aware", "--kv-index", "mooncake://h:1", "--kvs-backend", "redis"],
         "disagrees"),
        (["--policy", "kv_aware", "--kvs-chunk-size", "64"], "mooncake://... only"),
        (["--policy", "kv_aware", "--kv-index", "redis://127.0.0.1:1/0", "--kvs-hash-algo",
          "xxhash"], "mooncake://... only"),
        (["--policy", "kv_aware", "--kv-index", "mooncake://h:1", "--kvs-chunk-size", "0"],
         ">= 1"),
    ],
)  # fmt: skip
def test_bad_mooncake_flags_are_one_line_errors(argv, match):
    # refused by the config's checks, or by a field's bound while the flags are parsed
    with pytest.raises((ValueError, argparse.ArgumentError), match=match):
        route_config(*argv)


def test_go_hash_seed_must_be_an_integer(monkeypatch):
    monkeypatch.setenv("GO_HASH_SEED", "abc")
    with pytest.raises(ValueError, match="GO_HASH_SEED"):
        hash_seed()
    monkeypatch.delenv("GO_HASH_SEED")
    assert hash_seed() == 0


# ----- the host tier, from KV events' `medium` --------------------------------------------------


def offload(policy, worker, ids, evict=True):
    """`worker` computed `ids`, offloaded them to its host tier and (evict) dropped them from
    its device pool, as vLLM's KV events with CPU offloading say."""
    n = len(ids) // BS
    hashes = tuple(range(n))
    policy.index.apply(worker, [BlockStored(hashes, None, tuple(ids[: n * BS]), BS, "")])
    policy.index.apply(worker, [BlockStored(hashes, None, (), BS, "", "CPU")])
    if evict:
        policy.index.apply(worker, [BlockRemoved(hashes, "GPU")])


def test_a_prefix_evicted_to_the_host_tier_is_still_routed_to_its_holder():
    policy = KvAwarePolicy(CachePolicyConfig(cache_aware_scheduling_min_tokens=0))
    offload(policy, "w1", PROMPT)
    workers = [WorkerView("w0"), WorkerView("w1"), WorkerView("w2")]
    assert policy.cached_tokens(workers, view(PROMPT)).get("w1") == 0  # not on device
    assert policy.select(workers, view(PROMPT), 0.0) == 1
    req = view(PROMPT)
    policy.select(workers, req, 0.0)
    policy.on_dispatch("w1", req, 0.0)
    assert policy.loaded_tokens == len(PROMPT)


def test_host_holder_with_a_long_queue_yields_to_a_store_loader_or_an_idle_worker():
    # w1 can reload from its host (0.1 per token: ~102 tokens of work) but has 8,000 prefill
    # tokens queued (2,000 at PENDING_WEIGHT): an idle w0 recomputing 1,024 tokens wins
    policy = KvAwarePolicy(CachePolicyConfig(cache_aware_scheduling_min_tokens=0))
    offload(policy, "w1", PROMPT)
    workers = [WorkerView("w0"), WorkerView("w1", prefill_tokens=8000, reported_at=0.0)]
    assert policy.select(workers, view(PROMPT), 1.0) == 0
    # with the store also holding it for w0, w0 loads it instead of recomputing: same pick,
    # and the decision counts it as loaded
    policy = policy_with(FixedTier({"w0": len(PROMPT)}))
    offload(policy, "w1", PROMPT)
    req = view(PROMPT)
    assert policy.select(workers, req, 1.0) == 0
    policy.on_dispatch("w0", req, 1.0)
    assert policy.loaded_tokens == len(PROMPT) and policy.pending(workers[0]) == 0


def test_host_and_store_ratios_rank_device_first_then_cheapest_load():
    store = FixedTier({"w2": len(PROMPT)})
    policy = policy_with(store)
    hold(policy, "w0", PROMPT[: len(PROMPT) // 2])  # half on device, nothing lower
    offload(policy, "w1", PROMPT)  # all on host, loads at 0.3
    workers = [WorkerView("w0"), WorkerView("w1", kv_load_ratio=0.3),
               WorkerView("w2", kv_load_ratio=0.05)]  # fmt: skip
    # work: w0 512, w1 0.3 * 1024 = 307, w2 0.05 * 1024 = 51
    assert policy.select(workers, view(PROMPT), 0.0) == 2
    workers[2] = WorkerView("w2", kv_load_ratio=0.6)  # 614: now the host tier's w1 is cheapest
    assert policy.select(workers, view(PROMPT), 0.0) == 1


def test_prefill_work_prices_the_host_and_the_store_apart():
    # device 200, host up to 600, store up to 1,000: 400 loaded at each tier's ratio
    assert prefill_work(1000, 200, 600, 0.1, 1000, 0.5) == pytest.approx(40 + 200)
    # no store ratio reported: the default, and never less than the host's
    assert prefill_work(1000, 0, 0, 0.05, 1000) == pytest.approx(DEFAULT_LOAD_RATIO * 1000)
    assert prefill_work(1000, 0, 0, 0.3, 1000) == pytest.approx(300)
    assert prefill_work(1000, 0, 1000, 0.1, 1000, 0.5) == pytest.approx(100)  # host is nearer


def test_the_store_ratio_a_worker_reports_decides_who_loads():
    """Both hold the prompt lower down: w0 in its host tier, w1 only in the store. What each
    reports in /get_loads (read as the router reads it) decides, tier by tier."""
    from radixserve.router.proxy.worker_shapes import radixserve_load

    def worker(name, loads):
        load = radixserve_load({"num_running": 0, "num_waiting": 0, **loads})
        return WorkerView(name, kv_load_ratio=load.kv_load_ratio,
                          kv_store_load_ratio=load.kv_store_load_ratio)  # fmt: skip

    policy = policy_with(FixedTier({"w1": len(PROMPT)}))
    offload(policy, "w0", PROMPT)
    w0 = worker("w0", {"kv_load_to_prefill_ratio": 0.3})  # 0.3 * 1,024 = 307
    fast = worker("w1", {"kv_load_to_prefill_ratio": 0.3, "kv_store_load_to_prefill_ratio": 0.2})
    assert policy.select([w0, fast], view(PROMPT), 0.0) == 1  # 205
    slow = worker("w1", {"kv_load_to_prefill_ratio": 0.01, "kv_store_load_to_prefill_ratio": 0.4})
    assert policy.select([w0, slow], view(PROMPT), 0.0) == 0  # 410: its fast host is no help
    # measured nothing for the store yet (null): charged the default 0.1 -> 102, w1 again
    unmeasured = worker("w1", {"kv_load_to_prefill_ratio": 0.01,
                               "kv_store_load_to_prefill_ratio": None})  # fmt: skip
    assert policy.select([w0, unmeasured], view(PROMPT), 0.0) == 1


def test_reader_counts_a_tensor_parallel_workers_chunk_only_where_every_part_is(monkeypatch):
    """A tp 2 engine's keys end in the KV heads each rank's part holds (`key_parts`): the
    query asks for every part, and a chunk whose second part is missing ends the prefix."""
    reader = _reader()
    ns = "rkv1-0123456789abcdef"
    assert reader.register("tp1", {"kv_store": {"namespace": ns, "segment": None}})
    assert reader.register("tp2", {"kv_store": {"namespace": ns, "segment": None,
                                                "key_parts": ["h0-1", "h1-2"]}})  # fmt: skip
    ids = list(range(3 * 256))
    base = store_keys(ids, ns, 256)
    held = {*base, *(f"{k}_h0-1" for k in base), f"{base[0]}_h1-2", f"{base[1]}_h1-2"}
    asked = []

    async def aquery(keys):
        asked.extend(keys)
        return [KeyLocation(True, (Replica("127.0.0.1:7000", "memory", 64),)) if k in held
                else KeyLocation(False, (), "OBJECT_NOT_FOUND") for k in keys]  # fmt: skip

    monkeypatch.setattr(reader.client, "aquery", aquery)
    asyncio.run(reader.prepare(ids))
    assert sorted(asked) == sorted([*base, *(f"{k}_h0-1" for k in base),
                                    *(f"{k}_h1-2" for k in base)])  # fmt: skip
    assert reader.loadable_tokens(["tp1", "tp2"]) == {"tp1": 3 * 256, "tp2": 2 * 256}
