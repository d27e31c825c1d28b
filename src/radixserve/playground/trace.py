"""The 6-request trace: two system prompts A and B, requests arriving A, B, A, B, A, B, an engine
with room for 4 of them; walked through each policy by the real scheduler, request by request."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from radixserve.config import CacheConfig, SchedulerConfig
from radixserve.playground.runs import CLUSTER
from radixserve.sim.cluster import ClusterSim
from radixserve.sim.workloads import SIM_VOCAB_SIZE, WorkloadRequest

SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN = 1024, 32, 16
ROOM = 4  # requests the KV pool holds at once (prompt and output)
ORDER = "ABABAB"


def trace_requests() -> list[WorkloadRequest]:
    """A1, B1, A2, B2, A3, B3, in that order, all at time 0: all six wait when the engine
    first picks."""
    rng = random.Random(0)
    systems = {k: [rng.randrange(SIM_VOCAB_SIZE) for _ in range(SYSTEM_LEN)] for k in "AB"}
    out, seen = [], {"A": 0, "B": 0}
    for k in ORDER:
        seen[k] += 1
        question = [rng.randrange(SIM_VOCAB_SIZE) for _ in range(QUESTION_LEN)]
        rid = f"{k}{seen[k]}"
        out.append(WorkloadRequest(rid, 0.0, systems[k] + question, OUTPUT_LEN, group=k))
    return out


class _Recorder(ClusterSim):
    """A ClusterSim that keeps each finished request (the report keeps only aggregates)."""

    def _finish(self, rid: str) -> None:
        self.finished.append(self._live[rid][0])
        super()._finish(rid)


def walk(policy: str) -> list[dict[str, Any]]:
    """Each request's life under ``policy``: arrival, admission, first token, finish (virtual
    seconds) and how many prompt tokens it found cached."""
    kv = ROOM * (SYSTEM_LEN + QUESTION_LEN + OUTPUT_LEN)
    sim = _Recorder(
        CLUSTER,
        SchedulerConfig(schedule_policy=policy, max_running_requests=ROOM),
        CacheConfig(max_total_tokens=kv),
    )
    sim.finished = []
    reqs = trace_requests()
    sim.run(reqs)
    sim.check_integrity()
    by_rid = {r.rid: r for r in sim.finished}
    return [_row(by_rid[w.rid], w) for w in reqs]


def _row(req: Any, w: WorkloadRequest) -> dict[str, Any]:
    return {
        "rid": w.rid,
        "prompt": w.group,
        "arrival_s": req.arrival_time,
        "scheduled_s": req.first_scheduled_time,
        "first_token_s": req.first_token_time,
        "finish_s": req.finish_time,
        "prompt_tokens": len(req.input_ids),
        "cached_tokens": req.cached_tokens,
    }


def walk_all(policies: Sequence[str]) -> dict[str, Any]:
    return {
        "setup": {
            "order": list(ORDER),
            "system_prompt_len": SYSTEM_LEN,
            "question_len": QUESTION_LEN,
            "output_len": OUTPUT_LEN,
            "room": ROOM,
        },
        "policies": {p: walk(p) for p in policies},
    }
