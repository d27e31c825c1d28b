"""Token ids as compact arrays end to end: a request converts its prompt once, and the
scheduler's calls into the radix tree never convert one again; the tree evicts by the policy
named in the config, request priority included."""

from __future__ import annotations

import random
from array import array

from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.request import Req
from radixserve.sched.scheduler import Scheduler
from test_sched_support import Clock, KVRunner, drive, make_req, reference, tokens


def make(pool: int = 4096, policy: str = "lru", **kw: object) -> Scheduler:
    cache = CacheConfig(max_total_tokens=pool, radix_eviction_policy=policy)
    cfg = SchedulerConfig(**kw)  # type: ignore[arg-type]
    return Scheduler(cfg, cache, eos_token_ids=(7,), context_length=4096, clock=Clock())


def test_a_request_keeps_its_prompt_as_an_array() -> None:
    req = Req("r", [300, 301, 302])
    assert type(req.input_ids) is array and list(req.input_ids) == [300, 301, 302]
    same = array("I", [1, 2])
    assert Req("s", same).input_ids is same  # the tokenizer manager's array, taken as it is


def test_the_tree_never_converts_a_prompt_while_scheduling() -> None:
    """Every match and insert the scheduler makes hands the tree an array of its key type
    (``RadixCache._encode`` converts anything else): none across a whole run with shared
    prefixes, chunked prefill, retraction-free decoding and caching of finished requests."""
    rng = random.Random(5)
    shared = tokens(rng, 100)
    reqs = [make_req(f"r{i}", shared + tokens(rng, 10 + i), 8) for i in range(10)]
    sched = make(chunked_prefill_size=64, max_prefill_tokens=128)
    calls = []
    encode = sched.cache._encode
    sched.cache._encode = lambda ids: calls.append(len(ids)) or encode(ids)  # type: ignore[method-assign]
    for r in reqs:
        sched.add_request(r)
    outs = drive(sched, KVRunner(4096))
    for r in reqs:
        assert outs[r.rid] == reference(r.input_ids, 8, stop=(7,)), r.rid
    assert calls == [], f"the tree converted {len(calls)} token lists"
    sched.check_integrity()


def test_priority_eviction_keeps_the_high_priority_prompt() -> None:
    """With --radix-eviction-policy priority, a finished high-priority request's prompt stays
    cached while a newer low-priority one is evicted for a fresh request."""
    rng = random.Random(9)
    high, low, fresh = tokens(rng, 300), tokens(rng, 300), tokens(rng, 300)
    sched = make(pool=700, policy="priority")
    runner = KVRunner(700)
    for rid, ids, prio in (("high", high, 3), ("low", low, 0), ("fresh", fresh, 0)):
        req = make_req(rid, ids, 2)
        req.priority = prio
        sched.add_request(req)
        drive(sched, runner)
        sched.check_integrity()
    assert sched.cache.match_prefix(high).length >= 290
    assert sched.cache.match_prefix(low).length == 0
