"""Workload generators honour their parameters; hit rates match what their authors report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.sim.runner import SimRunner
from radixserve.sim.workloads import (
    WORKLOADS,
    MultiTurnConfig,
    SharedPrefixConfig,
    TraceConfig,
    WorkloadRequest,
    block_hit_rate,
    generated_shared_prefix,
    ideal_prefix_hit_rate,
    make_workload,
    multi_turn_chat,
    parse_text,
    read_trace,
    render_text,
    trace_replay,
)


def gsp(**kw: object) -> list[WorkloadRequest]:
    base = dict(num_groups=4, prompts_per_group=5, system_prompt_len=64, question_len=8)
    return generated_shared_prefix(SharedPrefixConfig(**{**base, **kw}))


def test_gsp_groups_share_exactly_their_system_prompt() -> None:
    reqs = gsp(output_len=7)
    assert len(reqs) == 20 and len({r.rid for r in reqs}) == 20
    assert all(len(r.input_ids) == 72 and r.output_len == 7 for r in reqs)
    by_group: dict[str, list[list[int]]] = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r.input_ids)
    assert len(by_group) == 4 and all(len(p) == 5 for p in by_group.values())
    for prompts in by_group.values():
        assert all(p[:64] == prompts[0][:64] for p in prompts)
    heads = {tuple(p[0][:64]) for p in by_group.values()}
    assert len(heads) == 4
    assert ideal_prefix_hit_rate(reqs) == pytest.approx(4 * 4 * 64 / (20 * 72), abs=0.01)


def test_gsp_order_arrivals_seed_and_length_range() -> None:
    ordered = gsp(ordered=True)
    assert [r.group for r in ordered] == sorted(r.group for r in ordered)
    assert [r.group for r in gsp()] != [r.group for r in ordered]  # shuffled by default
    assert all(r.arrival_s == 0 for r in ordered)
    timed = gsp(request_rate=10.0, num_groups=40)
    arrivals = [r.arrival_s for r in timed]
    assert arrivals == sorted(arrivals) and 10 < arrivals[-1] < 30  # 200 requests at 10/s
    assert gsp() == gsp() and gsp(seed=1) != gsp()
    ranged = gsp(range_ratio=0.5, output_len=10)
    assert all(32 + 4 <= len(r.input_ids) <= 72 and 5 <= r.output_len <= 10 for r in ranged)


def test_multi_turn_prompts_extend_the_previous_turn() -> None:
    cfg = MultiTurnConfig(num_sessions=3, turns=4, system_prompt_len=16, user_len=5, output_len=6)
    reqs = multi_turn_chat(cfg)
    assert len(reqs) == 12
    turns = {(r.session, r.turn): r for r in reqs}
    for (session, t), r in turns.items():
        assert r.input_ids[:16] == reqs[0].input_ids[:16]  # the shared system prompt
        assert len(r.input_ids) == 16 + 5 + t * (6 + 5)
        if t:
            prev = turns[session, t - 1]
            assert r.input_ids[: len(prev.input_ids)] == prev.input_ids
            assert r.prev_rid == prev.rid
            assert r.arrival_s == pytest.approx(prev.arrival_s + cfg.think_time_s)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


def test_multi_turn_history_holds_the_engines_own_reply() -> None:
    runner = SimRunner(vocab_size=1000)
    cfg = MultiTurnConfig(num_sessions=1, turns=2, system_prompt_len=4, user_len=3, output_len=5)
    first, second = multi_turn_chat(cfg, reply_fn=runner.generate)
    reply = runner.generate(first.input_ids, 5)
    assert second.input_ids[: len(first.input_ids) + 5] == first.input_ids + reply


def write_trace(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 600, "output_length": 4, "hash_ids": [0, 3]},
    {"timestamp": 2000, "input_length": 512, "output_length": 5, "hash_ids": [0]},
]


def test_trace_replay_maps_equal_blocks_to_equal_tokens(tmp_path: Path) -> None:
    reqs = trace_replay(TraceConfig(path=write_trace(tmp_path, ROWS)))
    assert [len(r.input_ids) for r in reqs] == [1100, 600, 512]
    assert [r.arrival_s for r in reqs] == [0.0, 1.5, 2.0]
    assert [r.output_len for r in reqs] == [3, 4, 5]
    a, b, c = (r.input_ids for r in reqs)
    assert a[:512] == b[:512] == c and a[512:600] != b[512:600]
    assert a[512] != b[512]  # blocks after one shared prefix differ at their first token
    assert block_hit_rate(reqs) == pytest.approx(2 / 6)
    # c is a's first block, cached whole, but an engine computes a prompt's last token, and
    # with 512-token pages that leaves no whole page cached
    assert ideal_prefix_hit_rate(reqs, page_size=512) == pytest.approx(512 / 2212)
    assert ideal_prefix_hit_rate(reqs) == pytest.approx((512 + 511) / 2212)


def _implied_common(a: WorkloadRequest, b: WorkloadRequest, block: int) -> int:
    """Tokens two trace prompts share by their hash ids: leading equal blocks, the shorter
    length of a block that ends either prompt (its last block is partial), nothing more."""
    common = 0
    for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids)):
        if x != y:
            break
        la = min(block, len(a.input_ids) - i * block)
        lb = min(block, len(b.input_ids) - i * block)
        common += min(la, lb)
        if la != lb:
            break
    return common


def test_trace_ids_stay_in_the_vocabulary_and_share_what_the_hash_ids_share(
    mooncake_trace: Path,
) -> None:
    """Mooncake's hash ids run past 60,000; every token id must still be one an engine with a
    32k vocabulary accepts (issue 17, point 1), and prefixes must be shared exactly as the
    hash ids say, so the hit rate is the one the trace implies."""
    reqs = trace_replay(TraceConfig(path=str(mooncake_trace), block_tokens=16, limit=300))
    assert max(h for r in reqs for h in r.hash_ids) * 16 >= 32000  # the old ids overflowed
    assert all(0 <= t < 31999 for r in reqs for t in r.input_ids)  # 31999: the sim's EOS
    for i, a in enumerate(reqs):
        for b in reqs[i + 1 :]:
            n = _implied_common(a, b, 16)
            assert a.input_ids[:n] == b.input_ids[:n], (a.rid, b.rid)
            if n < min(len(a.input_ids), len(b.input_ids)):
                assert a.input_ids[n] != b.input_ids[n], (a.rid, b.rid)


def test_a_trace_with_more_sibling_blocks_than_the_vocabulary_is_refused(tmp_path: Path) -> None:
    rows = [
        {"timestamp": i, "input_length": 10, "output_length": 1, "hash_ids": [i]} for i in range(5)
    ]
    with pytest.raises(ValueError, match="vocab-size"):
        trace_replay(TraceConfig(path=write_trace(tmp_path, rows), vocab_size=4))


def test_trace_options_and_bad_lines(tmp_path: Path) -> None:
    path = write_trace(tmp_path, ROWS)
    assert len(trace_replay(TraceConfig(path=path, limit=2))) == 2
    poisson = trace_replay(TraceConfig(path=path, request_rate=1000.0))
    assert 0 < poisson[0].arrival_s < poisson[-1].arrival_s < 1
    small = trace_replay(TraceConfig(path=path, block_tokens=16))
    assert [len(r.input_ids) for r in small] == [16 + 16 + 3, 16 + 3, 16]
    bad = write_trace(tmp_path, [{**ROWS[0], "input_length": 2000}])
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        read_trace(bad)


def test_mooncake_trace_hits_about_two_thirds_of_its_blocks(mooncake_trace: Path) -> None:
    records = read_trace(str(mooncake_trace))
    assert len(records) == 3993
    mean_input = sum(r.input_length for r in records) / len(records)
    assert 14_000 < mean_input < 16_500  # the paper: 15,325
    assert 0.60 <= block_hit_rate(records) <= 0.68  # the paper: 66%


def test_ideal_hit_rate_counts_prefixes_seen_earlier_in_whole_pages() -> None:
    def req(t: float, ids: list[int]) -> WorkloadRequest:
        return WorkloadRequest(f"r{t}", t, ids, 1)

    reqs = [req(2, [1, 2, 3, 5]), req(0, [1, 2, 3]), req(1, [1, 2, 4])]
    assert ideal_prefix_hit_rate(reqs) == pytest.approx((0 + 2 + 3) / 10)
    assert ideal_prefix_hit_rate(reqs, page_size=2) == pytest.approx((0 + 2 + 2) / 10)
    assert ideal_prefix_hit_rate([]) == 0.0


def test_render_text_is_one_word_per_token_and_reversible() -> None:
    ids = [0, 1, 63, 64, 4095, 4096, 10**6, 0]
    text = render_text(ids)
    assert len(text.split()) == len(ids) and text == render_text(ids)
    assert parse_text(text) == ids
    assert render_text([7, 8, 9]).startswith(render_text([7, 8]) + " ")
    with pytest.raises(ValueError):
        parse_text("hello")


def test_registry_builds_workloads_by_name() -> None:
    assert set(WORKLOADS) == {"generated-shared-prefix", "multi-turn", "shared-prefix-mix", "trace"}
    reqs = make_workload("generated-shared-prefix", num_groups=2, prompts_per_group=2)
    assert len(reqs) == 4
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("sharegpt")
    with pytest.raises(ValueError, match="num_group"):
        make_workload("multi-turn", num_group=2)
