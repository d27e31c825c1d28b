"""The scheduler with a host tier: a long random run (shared prefixes, a device pool far too
small for them, aborts, retractions) where the runner's KV lives in slots and the tier copies
move it. A prefix loaded from the host with wrong or stale bytes gives a wrong token, so output
equality with ``reference()`` proves the loads, stores and their order right."""

from __future__ import annotations

import random

import pytest

from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.batch import Batch, StepResult
from radixserve.sched.request import Req
from radixserve.sched.scheduler import Scheduler
from test_sched_support import Clock, KVRunner, assert_match_reference, make_req, tokens


class TieredKVRunner(KVRunner):
    """KVRunner plus a host tier: applies a batch's copies, in order, before its forward."""

    def __init__(self, num_slots: int, host_slots: int) -> None:
        super().__init__(num_slots)
        self.host_tok: list[int | None] = [None] * host_slots
        self.host_pos: list[int | None] = [None] * host_slots

    def run(self, batch: Batch) -> StepResult:
        for c in batch.kv_copies:
            for d, h in zip(c.device, c.host):
                if c.kind == "store":
                    self.host_tok[h], self.host_pos[h] = self.tok[d], self.pos[d]
                else:
                    self.tok[d], self.pos[d] = self.host_tok[h], self.host_pos[h]
        return super().run(batch)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_long_random_run_with_host_tier_gives_reference_outputs(policy: str, page: int) -> None:
    rng = random.Random(f"{policy}/{page}")
    pool, clock = 700, Clock()
    cfg = SchedulerConfig(max_running_requests=8, max_prefill_tokens=400, new_token_ratio=0.05,
                          min_new_token_ratio=0.05, new_token_ratio_decay=0.05)  # fmt: skip
    cache = CacheConfig(max_total_tokens=pool, page_size=page, enable_hierarchical_cache=True,
                        hicache_ratio=3.0, hicache_write_policy=policy)  # fmt: skip
    sched = Scheduler(
        cfg, cache, eos_token_ids=(7,), clock=clock, host_tokens=cache.host_tokens(None)
    )
    runner = TieredKVRunner(pool, sched.kv.host.total)
    prefixes = [tokens(rng, n) for n in (60, 120, 200, 250)]
    reqs: list[Req] = []
    for step in range(1500):
        if step < 700 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + tokens(rng, rng.randrange(1, 60))
            req = make_req(f"r{len(reqs)}", prompt, rng.randrange(1, 30),
                           namespace=rng.choice([None, None, "lora"]))  # fmt: skip
            sched.add_request(req)
            reqs.append(req)
        if reqs and rng.random() < 0.003:
            sched.abort(rng.choice(reqs).rid)
        batch = sched.step()
        sched.check_integrity()
        if batch is None:
            if step >= 700:
                break
            continue
        sched.on_output(batch, runner.run(batch))
        sched.check_integrity()
        clock.t += 0.005
    assert all(r.is_finished() for r in reqs)
    st = sched.stats()
    assert st.host_cached_prompt_tokens > 500, st  # the host tier served real prefixes
    assert_match_reference(reqs, stop=(7,))
    assert sched.flush_cache() and sched.allocator.available() == sched.allocator.total
    assert sched.kv.host.allocator.available() == sched.kv.host.total


def test_hicache_flags_need_the_switch_and_a_larger_host() -> None:
    with pytest.raises(ValueError, match="only with --enable-hierarchical-cache"):
        CacheConfig(hicache_write_policy="write_back")
    with pytest.raises(ValueError, match="must be > 1"):
        CacheConfig(enable_hierarchical_cache=True, hicache_ratio=0.5)
    with pytest.raises(ValueError, match="not more than the device pool"):
        big = CacheConfig(enable_hierarchical_cache=True, hicache_size=1, max_total_tokens=10**6)
        big.host_tokens(10_000)  # 1 GB holds 100k tokens of 10 kB: fewer than the device's 1M
    on = CacheConfig(enable_hierarchical_cache=True, max_total_tokens=1000)
    assert on.host_tokens(None) == 2000 and on.write_policy == "write_through"
    sized = CacheConfig(enable_hierarchical_cache=True, hicache_size=2, max_total_tokens=1000)
    assert sized.host_tokens(1_000_000) == 2000  # 2 GB at 1 MB a token
    assert Scheduler(cache_config=CacheConfig()).kv.host is None


def _drain(sched: Scheduler, runner: TieredKVRunner) -> list[list[str]]:
    """Step until idle; the rids each prefill batch admitted, in batch order."""
    admitted = []
    for _ in range(200):
        batch = sched.step()
        if batch is None:
            return admitted
        admitted.append([e.rid for e in batch.entries if e.is_prefill])
        sched.on_output(batch, runner.run(batch))
        sched.check_integrity()
    raise AssertionError("scheduler did not go idle")


def _host_only_prefix(
    cfg: SchedulerConfig, pool: int, page: int, prefix_len: int, filler: int, rng: random.Random
) -> tuple[Scheduler, TieredKVRunner, list[int]]:
    """A scheduler with a write-through host tier 4x its pool, and a prefix it computed and
    then lost from the device (a ``filler``-token prompt pushed it off) but keeps on the host."""
    cache = CacheConfig(max_total_tokens=pool, page_size=page, enable_hierarchical_cache=True,
                        hicache_ratio=4.0, hicache_write_policy="write_through")  # fmt: skip
    sched = Scheduler(cfg, cache, eos_token_ids=(), host_tokens=cache.host_tokens(None))
    runner = TieredKVRunner(pool, sched.kv.host.total)
    prefix = tokens(rng, prefix_len)
    sched.add_request(make_req("warm", prefix + tokens(rng, 8), 2))
    _drain(sched, runner)
    sched.add_request(make_req("filler", tokens(rng, filler), 2))  # pushes the prefix off
    _drain(sched, runner)
    return sched, runner, prefix


@pytest.mark.parametrize("page", [1, 4])
def test_lpm_counts_host_hits_a_host_only_prefix_goes_before_a_cold_request(page: int) -> None:
    """LPM orders by device + host match (SGLang's HiCache rule): a waiting request whose prefix
    lives only in the host tier is admitted before a cold one that arrived earlier, and loads
    its prefix from the host."""
    rng = random.Random(page)
    cfg = SchedulerConfig(schedule_policy="lpm", max_running_requests=1)
    sched, runner, prefix = _host_only_prefix(cfg, 256, page, 120, 220, rng)
    assert sched.kv.cache.host_only_size() >= 96, "the prefix should live in the host tier only"
    cold = make_req("cold", tokens(rng, 130), 2)
    hosted = make_req("hosted", prefix + tokens(rng, 10), 2)
    sched.add_request(cold)
    sched.add_request(hosted)
    assert hosted.prefix_len == 0 and hosted.host_len >= 96  # nothing on the device, all on host
    order = [rids[0] for rids in _drain(sched, runner) if rids]
    assert order[0] == "hosted", order
    assert hosted.host_cached_tokens >= 96 and cold.cached_tokens == 0
    assert_match_reference([cold, hosted], stop=())


def test_a_chunked_prefill_loads_the_whole_host_match_at_once() -> None:
    """Host-tier tokens are loaded, not computed, so they take no share of the step's token
    budget: with 64-token chunks (a CPU's 1,024 in miniature) a prompt whose 160-token prefix
    lives only in the host tier loads all 160 in its first step and computes the rest in
    chunks, instead of loading one chunk and recomputing the remainder."""
    rng = random.Random(3)
    cfg = SchedulerConfig(max_prefill_tokens=64, chunked_prefill_size=64, enable_mixed_chunk=True)
    sched, runner, prefix = _host_only_prefix(cfg, 320, 1, 160, 300, rng)
    hosted = make_req("hosted", prefix + tokens(rng, 100), 2)
    sched.add_request(hosted)
    assert hosted.prefix_len == 0 and hosted.host_len == 160
    batch = sched.step()
    assert batch is not None
    (entry,) = batch.entries
    assert entry.start_pos == 160 and len(entry.token_ids) == 64  # 160 loaded, a chunk computed
    sched.on_output(batch, runner.run(batch))
    _drain(sched, runner)
    assert hosted.host_cached_tokens == 160
    assert_match_reference([hosted], stop=())
