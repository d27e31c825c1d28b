"""kv_aware as a pure policy: in-memory workers, an in-memory index fed with events."""

from __future__ import annotations

import pytest

from radixserve.router.kvindex.block_index import InMemoryIndex
from radixserve.router.kvindex.event_format import BlockRemoved, BlockStored, namespace_string
from radixserve.router.policies.base import RequestView, WorkerView
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.eviction_placement import EVICTING_SECS, HELD_QUEUE_SPAN
from radixserve.router.policies.kv_aware import KEEP_SHARE, PENDING_WEIGHT, KvAwarePolicy
from radixserve.router.policies.registry import create_policy

BS = 16
SHARED = list(range(1000, 1000 + 8 * BS))  # 8 blocks


def view(ids, salt=""):
    return RequestView.from_prompt(input_ids=ids, cache_salt=salt)


def hold(policy, worker, ids, ns="", tag=0):
    """`worker` announces every whole block of `ids` (engine hashes: (tag, i))."""
    n = len(ids) // BS
    hashes = tuple((tag << 20) + i for i in range(n))
    policy.index.apply(worker, [BlockStored(hashes, None, tuple(ids[: n * BS]), BS, ns)])
    return hashes


def fleet(n=3, **kw):
    return [WorkerView(f"w{i}", **kw) for i in range(n)]


def test_registered_and_built_by_name():
    assert isinstance(create_policy("kv_aware"), KvAwarePolicy)


def test_goes_to_the_worker_that_holds_the_prefix():
    policy = KvAwarePolicy()
    hold(policy, "w0", SHARED)
    hold(policy, "w2", SHARED[: 2 * BS], tag=2)
    assert policy.select(fleet(), view(SHARED + [7] * 40), 0.0) == 0
    assert policy.cached_tokens(fleet(), view(SHARED + [7] * 40)) == {
        "w0": 8 * BS,
        "w1": 0,
        "w2": 2 * BS,
    }


def test_eviction_moves_the_expectation():
    policy = KvAwarePolicy()
    hashes = hold(policy, "w1", SHARED)
    assert policy.select(fleet(), view(SHARED), 0.0) == 1
    policy.index.apply("w1", [BlockRemoved(hashes[:1])])  # the first block left: no hit at all
    assert policy.cached_tokens(fleet(), view(SHARED))["w1"] == 0


def test_pending_prefill_spreads_a_burst_of_new_prompts():
    policy = KvAwarePolicy()
    workers, picks = fleet(), []
    for k in range(6):
        req = view([k * 10_000 + t for t in range(4 * BS)])
        i = policy.select(workers, req, 0.0)
        policy.on_dispatch(workers[i].id, req, 0.0)
        picks.append(i)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_a_hit_outweighs_queued_prefill_up_to_the_pending_weight():
    policy = KvAwarePolicy()
    hold(policy, "w0", SHARED)
    # The hit saves 128 prefill tokens; each queued token weighs PENDING_WEIGHT (1/4): w0 with
    # 31 blocks (496 tokens, 124 weighted) queued still wins, with 33 (528, 132) it does not.
    assert PENDING_WEIGHT == 0.25
    workers = fleet(2)
    busy = view([5] * 31 * BS)
    policy.on_dispatch("w0", busy, 0.0)
    assert policy.select(workers, view(SHARED), 0.0) == 0
    policy.on_complete("w0", busy, 0.0)
    policy.on_dispatch("w0", view([6] * 33 * BS), 0.0)
    assert policy.select(workers, view(SHARED), 0.0) == 1


def test_in_flight_prompts_count_as_held_until_they_complete():
    # No events yet (the first request's prefill is still queued), but a second request with
    # the same prefix will hit behind it: it follows, and stops expecting that once the first
    # completes without the worker announcing the blocks (it evicted them).
    policy = KvAwarePolicy()
    workers = fleet(3)
    hold(policy, "w1", [9] * BS)  # the index knows w1's block size
    first = view(SHARED + [1] * BS)
    policy.on_dispatch("w1", first, 0.0)
    assert policy.cached_tokens(workers, view(SHARED))["w1"] == 8 * BS
    assert policy.select(workers, view(SHARED + [2] * BS), 0.0) == 1
    policy.on_complete("w1", first, 1.0)
    assert policy.cached_tokens(workers, view(SHARED))["w1"] == 0


def test_worker_reports_replace_dispatches_up_to_the_report():
    policy = KvAwarePolicy()
    req = view([3] * 10 * BS)
    policy.on_dispatch("w0", req, 1.0)
    before = WorkerView("w0", prefill_tokens=0, reported_at=0.5)
    after = WorkerView("w0", prefill_tokens=0, reported_at=2.0)
    policy.select([before], view([1] * BS), 1.5)
    assert policy.pending(before) == 10 * BS  # the report predates the dispatch
    policy.select([after], view([1] * BS), 2.5)
    assert policy.pending(after) == 0  # the worker computed it (or counts it itself)


def test_a_report_stops_counting_the_requests_that_finished_after_it():
    # a report asked while one request waited kept its tokens against an idle worker until the
    # next poll: every new prefix sent one at a time in between went to the other worker
    policy = KvAwarePolicy()
    waited, later = view([3] * 10 * BS), view([4] * 6 * BS)
    policy.on_dispatch("w0", waited, 1.0)
    report = WorkerView("w0", prefill_tokens=10 * BS + 50, reported_at=1.5)  # 50: another client's
    policy.on_dispatch("w0", later, 1.6)  # after the report: not in it
    assert policy.pending(report) == 16 * BS + 50
    policy.on_complete("w0", waited, 2.0)
    policy.on_complete("w0", later, 2.0)
    assert policy.pending(report) == 50  # the report's other tokens still count
    policy.on_dispatch("w0", waited, 2.5)
    newer = WorkerView("w0", prefill_tokens=0, reported_at=3.0)  # asked after the completions
    policy.select([newer], view([1] * BS), 3.1)
    policy.on_complete("w0", waited, 3.2)  # sent before it, done after it: never below 0
    assert policy.pending(newer) == 0


def test_new_prefixes_go_round_workers_whose_reports_are_out_of_date():
    policy = KvAwarePolicy()
    waited = view([3] * 10 * BS)
    policy.on_dispatch("w0", waited, 1.0)
    workers = [WorkerView("w0", prefill_tokens=10 * BS, reported_at=1.5),
               WorkerView("w1", prefill_tokens=0, reported_at=1.5)]  # fmt: skip
    policy.on_complete("w0", waited, 2.0)
    picks = []
    for i in range(4):  # one at a time, each done before the next, all before the next poll
        req = view([100 + i] * 4 * BS)
        picks.append(policy.select(workers, req, 2.1 + i))
        policy.on_dispatch(workers[picks[-1]].id, req, 2.1 + i)
        policy.on_complete(workers[picks[-1]].id, req, 2.2 + i)
    assert sorted(picks) == [0, 0, 1, 1]  # without: all four to w1


def test_ties_go_to_fewer_running_requests():
    policy = KvAwarePolicy()
    workers = [WorkerView("w0", load=3), WorkerView("w1", load=1), WorkerView("w2", load=2)]
    assert policy.select(workers, view(SHARED), 0.0) == 1


def test_short_prompts_are_placed_by_load_alone():
    policy = KvAwarePolicy(CachePolicyConfig(cache_aware_scheduling_min_tokens=64))
    hold(policy, "w0", SHARED)
    workers = [WorkerView("w0", load=2), WorkerView("w1", load=0)]
    assert policy.select(workers, view(SHARED[: 2 * BS]), 0.0) == 1
    assert policy.select(workers, view(SHARED), 0.0) == 0


def test_short_prompts_one_at_a_time_go_round_an_idle_fleet():
    # Under cache_aware_scheduling_min_tokens (16: less than one block) every worker ties on
    # load and queue: they went to the first worker, one after another.
    policy = KvAwarePolicy()
    workers = fleet(3)
    picks = []
    for k in range(6):
        req = view([k] * 5)
        i = policy.select(workers, req, 0.0)
        policy.on_dispatch(workers[i].id, req, 0.0)
        policy.on_complete(workers[i].id, req, 0.0)
        picks.append(i)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_namespaces_never_hit_each_other():
    policy = KvAwarePolicy()
    hold(policy, "w2", SHARED, ns=namespace_string(None, "tenant-a"))
    assert policy.cached_tokens(fleet(), view(SHARED))["w2"] == 0
    assert policy.cached_tokens(fleet(), view(SHARED, salt="tenant-a"))["w2"] == 8 * BS


def test_workers_without_events_are_scored_from_the_approximate_tree():
    policy = KvAwarePolicy()
    hold(policy, "w0", [9] * BS)  # w0 publishes (holds something else); w1, w2 do not
    first = view(SHARED)
    policy.on_dispatch("w2", first, 0.0)
    policy.on_complete("w2", first, 0.0)
    got = policy.cached_tokens(fleet(), view(SHARED))
    assert got == {"w0": 0, "w1": 0, "w2": 8 * BS}
    assert policy.select(fleet(), view(SHARED), 1.0) == 2


def test_overloaded_holder_is_skipped_unless_it_holds_nearly_all_and_removal_forgets():
    policy = KvAwarePolicy(CachePolicyConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    hold(policy, "w0", SHARED)
    workers = [WorkerView("w0", load=10), WorkerView("w1", load=1)]
    assert policy.select(workers, view(SHARED + [7] * 2 * BS), 0.0) == 1  # holds 80%: skipped
    assert policy.select(workers, view(SHARED), 0.0) == 0  # holds all of it: stays eligible
    # busier than the mean by more than Poisson noise (the ceiling), not overloaded
    crowd = [WorkerView("w0", load=30)] + [WorkerView(f"w{i}", load=10) for i in range(1, 8)]
    policy = KvAwarePolicy()
    hold(policy, "w0", SHARED)
    assert policy.select(crowd, view(SHARED + [7] * 2 * BS), 0.0) != 0
    assert policy.select(crowd, view(SHARED), 0.0) == 0
    policy.on_worker_removed("w0")
    assert policy.index.blocks() == {}


def test_unhealthy_holder_is_not_picked_and_hit_rate_is_reported():
    policy = KvAwarePolicy()
    hold(policy, "w0", SHARED)
    workers = [WorkerView("w0", healthy=False), WorkerView("w1")]
    req = view(SHARED)
    assert policy.select(workers, req, 0.0) == 1
    policy.on_dispatch("w1", req, 0.0)
    req2 = view(SHARED)
    assert policy.select(fleet(1), req2, 0.0) == 0
    policy.on_dispatch("w0", req2, 0.0)
    assert policy.expected_hit_rate() == 0.5


def evicting_fleet(extra_blocks):
    """Three workers that all hold SHARED, and `extra_blocks[i]` blocks of other prompts each;
    w1 has the fewest requests running, so it is what the score picks among equal holders."""
    policy = KvAwarePolicy()
    for i, extra in enumerate(extra_blocks):
        hold(policy, f"w{i}", SHARED + [50_000 + i] * extra * BS, tag=i)
    workers = [WorkerView("w0", load=1), WorkerView("w1", load=0), WorkerView("w2", load=1)]
    return policy, workers


def test_while_evicting_a_shared_prompt_goes_to_the_worker_holding_least():
    policy, workers = evicting_fleet([40, 20, 5])
    session = view(SHARED + [7] * 2 * BS)  # all hold its first 8 blocks, none the rest
    assert policy.select(workers, session, 10.0) == 1  # nothing evicted: the score decides
    last = (0 << 20) + 8 + 39  # w0's last block: it evicts
    policy.index.apply("w0", [BlockRemoved((last,))])
    assert policy.select(workers, session, 10.5) == 2  # holds 13 blocks, the others 28, 47
    assert policy.select(workers, session, 10.5 + EVICTING_SECS - 0.1) == 2
    assert policy.select(workers, session, 10.5 + EVICTING_SECS) == 1  # the removal is old


def test_placement_by_holdings_skips_long_queues_and_leaves_distinct_holders_alone():
    policy, workers = evicting_fleet([200, 150, 0])
    session = view(SHARED + [7] * 2 * BS)
    span = HELD_QUEUE_SPAN * len(session.token_ids)
    policy.index.apply("w1", [BlockRemoved(((1 << 20) + 8 + 149,))])
    queued = view([60_000 + t for t in range(span)])  # w2's queue: one span over the shortest
    policy.on_dispatch("w2", queued, 10.0)
    assert policy.select(workers, session, 10.0) == 2  # within the span: smallest footprint
    more = view([61_000])
    policy.on_dispatch("w2", more, 10.0)
    assert policy.select(workers, session, 10.0) == 1  # beyond it: the next smallest
    # A worker that holds more of the prompt than the others is the score's to choose.
    hold(policy, "w0", SHARED + [7] * 2 * BS, tag=9)
    assert policy.select(workers, session, 10.0) == 0


def test_while_evicting_full_caches_spread_new_sessions_instead_of_chasing_a_block():
    """vLLM's caches stay full once warm: two evicting workers hold their capacity give or take
    a block, which says nothing about room. New sessions (sharing only the system prompt) then
    go to the worker sent fewest requests lately, by turns, not all to the one that happened
    to hold a block less (issue 26: on two real vLLM servers that lost 5 points of hits)."""
    policy = KvAwarePolicy()
    hold(policy, "w0", SHARED + [50_000] * 37 * BS, tag=0)  # 45 blocks
    hold(policy, "w1", SHARED + [50_001] * 36 * BS, tag=1)  # 44 blocks: one less
    policy.index.apply("w0", [BlockRemoved(((0 << 20) + 44,))])
    policy.index.apply("w1", [BlockRemoved(((1 << 20) + 43,))])  # both evict: 44 and 43
    workers = fleet(2)
    picks = []
    for k in range(6):
        session = view(SHARED + [70_000 + k] * 4 * BS)
        now = 10.0 + 0.1 * k  # within EVICTING_SECS of the removals
        pick = policy.select(workers, session, now)
        policy.on_dispatch(workers[pick].id, session, now)
        policy.on_complete(workers[pick].id, session, now)
        picks.append(pick)
    assert sorted(picks) == [0, 0, 0, 1, 1, 1], picks


def test_spill_never_moves_a_request_off_a_worker_holding_nearly_all_of_it():
    policy = KvAwarePolicy()
    workers = fleet(2)
    policy.select(workers, view([1] * BS), 0.0)  # both routable from the start
    for k in range(12):  # w0 was sent 12 requests lately, w1 none: w0 is over its share
        req = view([k * 1_000 + t for t in range(BS)])
        policy.on_dispatch("w0", req, 0.0)
        policy.on_complete("w0", req, 0.0)
    hold(policy, "w0", SHARED)
    assert KEEP_SHARE == 0.95
    assert policy.select(workers, view(SHARED), 1.0) == 0  # holds all of it: stays
    assert policy.select(workers, view(SHARED + [7] * 2 * BS), 1.0) == 1  # 80%: spilled


def test_a_prompt_is_hashed_once_for_the_lookup_and_the_dispatch(monkeypatch):
    import radixserve.router.kvindex.block_index as index_module

    calls = []
    real = index_module.block_keys

    def counting(token_ids, block_size, namespace=""):
        calls.append(block_size)
        return real(token_ids, block_size, namespace)

    monkeypatch.setattr(index_module, "block_keys", counting)
    policy = KvAwarePolicy()
    hold(policy, "w0", SHARED)
    req = view(SHARED + [7] * 2 * BS)
    i = policy.select(fleet(), req, 0.0)
    policy.on_dispatch(f"w{i}", req, 0.0)
    assert calls == [BS]  # one block size, hashed once for both
    other = view(SHARED + [8] * 2 * BS)
    policy.on_dispatch(f"w{policy.select(fleet(), other, 0.0)}", other, 0.0)
    assert calls == [BS, BS]  # the next request is hashed anew


class DownableIndex(InMemoryIndex):
    """An in-memory index that can stop answering as a whole, as Redis does for the router."""

    down = False

    def prefix_tokens(self, workers, keys_for):
        return {} if self.down else super().prefix_tokens(workers, keys_for)

    def answering(self) -> bool:
        return not self.down


def test_index_down_falls_back_to_the_tree_kept_while_it_answered():
    """Issue 25: with the index down, each prefix group's next request still goes to the
    worker that holds it (the tree learnt every dispatch while the index answered)."""
    index = DownableIndex()
    policy, workers, holders = KvAwarePolicy(index=index), fleet(), []
    groups = [[g * 10_000 + t for t in range(8 * BS)] for g in range(9)]
    for g, ids in enumerate(groups):
        req = view(ids + [7, g])
        i = policy.select(workers, req, 0.0)
        policy.on_dispatch(workers[i].id, req, 0.0)
        policy.on_complete(workers[i].id, req, 0.0)
        hold(policy, workers[i].id, ids, tag=g)  # the holder announces the prompt's blocks
        holders.append(i)
    assert sorted(set(holders)) == [0, 1, 2]
    index.down = True
    assert [policy.select(workers, view(ids + [9, g]), 1.0) for g, ids in enumerate(groups)] == (
        holders
    )


class VllmLike:
    """A worker as vLLM caches: after a request, the full blocks of its prompt are announced
    (chained engine hashes derived from the content, each block once)."""

    def __init__(self, policy, worker, block_size):
        self.policy, self.worker, self.bs = policy, worker, block_size
        self.held: set[int] = set()

    def run(self, ids):
        stored, parent = [], None
        for end in range(self.bs, len(ids) + 1, self.bs):
            h = hash(tuple(ids[:end])) & 0xFFFF_FFFF_FFFF
            if h not in self.held:
                self.held.add(h)
                event = BlockStored((h,), parent, tuple(ids[end - self.bs : end]), self.bs, "")
                stored.append(event)
            parent = h
        self.policy.index.apply(self.worker, stored)


def one_at_a_time(policy, engines, prompts):
    """Each prompt routed, run to completion (blocks announced) before the next: the picks."""
    workers, picks = [WorkerView(e.worker) for e in engines], []
    for ids in prompts:
        req = view(ids)
        i = policy.select(workers, req, 0.0)
        policy.on_dispatch(workers[i].id, req, 0.0)
        engines[i].run(ids)
        policy.on_complete(workers[i].id, req, 0.0)
        picks.append(i)
    return picks


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("repeated", ["each in turn", "one hot prompt"])
def test_issue_26_new_prompts_spread_and_repeats_go_to_their_holder(block_size, repeated):
    # Issue 26 on two vLLM workers: 4 new prompts of 684 tokens, then 12 repeats (the same 672
    # leading tokens, a new 12-token suffix), one at a time. At 128-token blocks the holder has
    # 640 of 684 tokens (93.6%) and that is all it can have: vLLM caches full blocks only.
    policy = KvAwarePolicy()
    engines = [VllmLike(policy, f"w{i}", block_size) for i in range(2)]
    bodies = [[p * 100_000 + t for t in range(672)] for p in range(4)]
    firsts = one_at_a_time(policy, engines, [b + [1] * 12 for b in bodies])
    assert sorted(firsts) == [0, 0, 1, 1]  # spread, never piled on one worker
    order = [k % 4 for k in range(12)] if repeated == "each in turn" else [0] * 12
    repeats = [bodies[p] + [50 + k] * 12 for k, p in enumerate(order)]
    picks = one_at_a_time(policy, engines, repeats)
    assert picks == [firsts[p] for p in order]  # 12 of 12 to the holder


def test_a_hold_counts_against_what_the_worker_can_serve():
    # 684 tokens at 128-token blocks: 5 full blocks before the last token (640) are all a
    # worker can hold, and holding them keeps it over the load gates and the spill.
    policy = KvAwarePolicy(CachePolicyConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    engine = VllmLike(policy, "w0", 128)
    ids = list(range(684))
    engine.run(ids)
    workers = [WorkerView("w0", load=10), WorkerView("w1", load=1)]
    assert policy.cached_tokens(workers, view(ids))["w0"] == 640
    assert policy.select(workers, view(ids), 0.0) == 0


def chat_picks(policy, chats=4, turns=3):
    """Chats sharing a 4-block system prompt, each opening with 8 blocks of its own, then
    growing by 2 blocks a turn, one request at a time on 2 idle workers, the engine announcing
    every prompt it served: per chat, the worker of each turn."""
    system = list(range(5_000, 5_000 + 4 * BS))
    prompts = [system + [20_000 + 1_000 * c + t for t in range(8 * BS)] for c in range(chats)]
    workers, where, tag = fleet(2), [""] * chats, 0
    for turn in range(turns):
        for c in range(chats):
            req, now = view(prompts[c]), 10.0 * turn + c
            pick = policy.select(workers, req, now)
            policy.on_dispatch(workers[pick].id, req, now)
            tag += 1
            hold(policy, workers[pick].id, prompts[c], tag=tag)
            policy.on_complete(workers[pick].id, req, now)
            where[c] += str(pick)
            prompts[c] += [90_000 + 1_000 * c + 100 * turn + t for t in range(2 * BS)]
    return where


def test_new_chats_sharing_a_small_system_prompt_spread_and_their_turns_stay():
    """Issue 26 on two vLLM servers: a hold that is a small part of the prompt (a shared system
    prompt, a third of a new chat's first turn: at most cache_threshold of it) is no reason to
    prefer its holder, so new chats go round the idle workers instead of all to the one that
    served the first (which then evicts); later turns, mostly held, stay with their holder."""
    where = chat_picks(KvAwarePolicy())
    assert sorted(w[0] for w in where) == ["0", "0", "1", "1"], where
    assert all(len(set(w)) == 1 for w in where), where
    # cache_threshold 0: any hold decides, and every chat follows the first one's worker
    where = chat_picks(KvAwarePolicy(CachePolicyConfig(cache_threshold=0.0)))
    assert len({w[0] for w in where}) == 1, where


def test_a_substantial_hold_still_goes_to_its_holder_when_others_were_sent_less():
    """A long document asked again with a new question (over cache_threshold of the prompt
    held) goes to its holder even though the other worker was sent fewer requests lately."""
    policy, workers = KvAwarePolicy(), fleet(2)
    doc = [30_000 + t for t in range(10 * BS)]
    hold(policy, "w0", doc, tag=1)
    for k in range(3):
        policy.on_dispatch("w0", view([40_000 + 100 * k + t for t in range(BS)]), 0.0)
    repeat = view(doc + [50_000 + t for t in range(6 * BS)])  # 10 blocks of 16 held: 62%
    assert policy.select(workers, repeat, 1.0) == 0
    short = view(doc[: 4 * BS] + [60_000 + t for t in range(8 * BS)])  # 4 of 12 blocks: 33%
    assert policy.select(workers, short, 1.0) == 1


def test_a_small_hold_counts_again_while_the_fleet_evicts():
    """The small-hold rule applies while nothing is evicted: then a new session whose only
    hold is a shared prompt on one worker (40% of it) goes to the worker sent fewer requests
    lately; while the fleet evicts, the score decides as before and the holder takes it."""
    policy, workers = KvAwarePolicy(), fleet(2)
    hold(policy, "w0", SHARED + [50_000] * 40 * BS, tag=0)  # 48 blocks
    hold(policy, "w1", [50_001] * 10 * BS, tag=1)  # 10 blocks
    policy.select(workers, view([1]), 10.0)  # a short prompt: both workers seen, none sent
    for k in range(2):
        short = view([40_000 + 100 * k + t for t in range(BS)])
        policy.on_dispatch("w0", short, 10.0)
        policy.on_complete("w0", short, 10.0)
    session = view(SHARED + [70_000 + t for t in range(12 * BS)])  # w0 holds 8 of 20 blocks
    assert policy.select(workers, session, 10.0) == 1  # nothing evicted: sent fewer lately
    policy.index.apply("w1", [BlockRemoved(((1 << 20) + 9,))])
    assert policy.select(workers, session, 11.0) == 0  # evicting: the holder
    assert policy.select(workers, session, 11.0 + EVICTING_SECS) == 1
