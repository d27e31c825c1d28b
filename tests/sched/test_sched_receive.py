"""The decode role: a request whose prompt was computed elsewhere reserves its slots, receives
its KV and first token, and decodes to its end without a prefill step; no room is refused
without keeping anything; an abort while the KV is on its way frees it and caches nothing."""

from __future__ import annotations

import pytest

from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.sched.batch import StepResult
from radixserve.sched.request import Req, SamplingParams
from radixserve.sched.scheduler import Scheduler
from test_sched_support import Clock


def make(pool: int, page: int = 1) -> Scheduler:
    cache = CacheConfig(max_total_tokens=pool, page_size=page)
    return Scheduler(SchedulerConfig(), cache, clock=Clock())


def req(rid: str, prompt: int, new: int) -> Req:
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    return Req(rid, list(range(10, 10 + prompt)), sp)


@pytest.mark.parametrize("page", [1, 4])
def test_received_requests_decode_to_their_end_and_never_prefill(page: int) -> None:
    sched = make(400, page)
    a, b = req("a", 100, 20), req("b", 150, 30)
    assert sched.reserve(a) and sched.reserve(b)
    sched.check_integrity()
    assert sched.step() is None  # nothing decodes before its KV has landed
    sched.receive("a", 5)
    steps = 0
    while (batch := sched.step()) is not None:
        assert not any(e.is_prefill for e in batch.entries)
        sched.on_output(batch, StepResult([7] * len(batch.entries)))
        sched.check_integrity()
        if steps == 3:
            sched.receive("b", 6)
        steps += 1
    assert a.output_ids == [5] + [7] * 19 and b.output_ids == [6] + [7] * 29
    kv = sched.kv  # both finished: their sequences are cached, nothing is held
    assert kv.allocator.available() + kv.cache.evictable_size() == kv.total
    assert sched.cache.match_prefix(a.input_ids).length == (100 // page) * page


def test_no_room_for_the_whole_generation_is_refused_keeping_nothing() -> None:
    sched = make(400)
    assert sched.reserve(req("a", 100, 200))  # 299 slots at its end
    before = sched.kv.allocator.available()
    late = req("b", 50, 60)  # 109 more: 408 > 400
    assert not sched.reserve(late)
    assert sched.kv.allocator.available() == before and sched.get("b") is None
    sched.check_integrity()
    with pytest.raises(ValueError, match="needs more KV slots than the pool holds"):
        sched.reserve(req("c", 390, 20))


def test_an_abort_while_the_kv_is_on_its_way_frees_it_and_caches_nothing() -> None:
    sched = make(400)
    a = req("a", 100, 20)
    assert sched.reserve(a)
    assert sched.abort("a")
    sched.check_integrity()
    assert sched.kv.allocator.available() == 400
    assert sched.cache.match_prefix(a.input_ids).length == 0


def test_one_new_token_ends_on_the_token_received_and_caches_the_prompt() -> None:
    sched = make(400)
    a = req("a", 100, 1)  # the prefill engine samples the only token; nothing decodes here
    assert sched.reserve(a)
    out = sched.receive("a", 5)
    assert out.finished and a.output_ids == [5]
    assert sched.step() is None
    sched.check_integrity()
    kv = sched.kv
    assert kv.allocator.available() + kv.cache.evictable_size() == kv.total
    assert sched.cache.match_prefix(a.input_ids).length == 100


@pytest.mark.parametrize("page", [1, 4])
def test_a_prompt_whose_prefix_this_engine_holds_reserves_only_the_rest(page: int) -> None:
    sched = make(400, page)
    a = req("a", 100, 3)
    assert sched.reserve(a) and a.prefix_len == 0
    sched.receive("a", 5)
    while (batch := sched.step()) is not None:
        sched.on_output(batch, StepResult([7] * len(batch.entries)))
    b = Req("b", [*a.input_ids[:82], *range(900, 930)], SamplingParams(max_new_tokens=4))
    free = sched.kv.allocator.available()
    assert sched.reserve(b)
    assert b.prefix_len == (82 // page) * page  # the tree's pages, locked for it
    held = sched.slot_table.slots("b")
    assert (
        list(held[: b.prefix_len])
        == list(sched.cache.match_prefix(a.input_ids).slots)[: b.prefix_len]
    )
    assert free - sched.kv.allocator.available() <= 112 - b.prefix_len + page
    sched.check_integrity()
    assert sched.abort("b")  # its pages never came: the shared prefix stays cached
    sched.check_integrity()
    assert sched.cache.match_prefix(a.input_ids).length == (100 // page) * page
    c = req("c", 100, 2)  # the whole prompt held: nothing to receive
    assert sched.reserve(c) and c.prefix_len == (100 // page) * page
    sched.check_integrity()


def test_a_held_request_keeps_its_slots_after_it_ends_until_released() -> None:
    # the prefill role: a finished prompt's slots are read by a transfer off the loop
    sched = make(400, 4)
    a = req("a", 102, 1)  # a partial last page, which ending would free at once
    sched.add_request(a)
    batch = sched.step()
    assert batch is not None
    sched.hold("a")
    (out,) = sched.on_output(batch, StepResult([5]))
    assert out.finished and sched.get("a") is None and "a" in sched.held
    assert len(sched.slot_table.slots("a")) == 102  # every row still readable
    assert sched.kv.allocator.available() == 400 - 104
    assert not sched.flush_cache()
    sched.check_integrity()
    sched.release_held("a")
    sched.check_integrity()
    assert not sched.held and sched.cache.match_prefix(a.input_ids).length == 100
    assert sched.kv.allocator.available() + sched.cache.evictable_size() == 400
