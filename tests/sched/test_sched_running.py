"""The running set's new-token ratio: a decay of many steps at once, worked out from a curve,
lands exactly where one subtraction a step does (the simulator's decode runs rely on it)."""

from __future__ import annotations

import pytest

from radixserve.config import SchedulerConfig
from radixserve.sched.running import CURVE_STEPS, RunningSet


def stepwise(ratio: float, steps: int, cfg: SchedulerConfig) -> float:
    """The decay as single decode steps make it: one subtraction each, down to the floor."""
    for _ in range(steps):
        ratio = max(ratio - cfg.new_token_ratio_decay, cfg.min_new_token_ratio)
    return ratio


@pytest.mark.parametrize(
    "cfg",
    [
        SchedulerConfig(),  # 0.7 down to 0.1 by 0.001: 600 steps to the floor
        SchedulerConfig(new_token_ratio_decay=1e-5),  # longer than the curve worked out
        SchedulerConfig(new_token_ratio_decay=0.0),  # never moves
        SchedulerConfig(new_token_ratio=0.3, min_new_token_ratio=0.3),  # at the floor at once
    ],
)
def test_a_decay_of_many_steps_equals_one_subtraction_a_step(cfg: SchedulerConfig) -> None:
    running, want = RunningSet(cfg), cfg.new_token_ratio
    for steps in (1, 7, 1, 250, 0, 399, 1, 3, CURVE_STEPS + 5, 1, 2 * CURVE_STEPS):
        running.decay(steps)
        want = stepwise(want, steps, cfg)
        assert running.ratio == want  # exact: the same floats, not close ones
    running.ratio = want = 0.6512345  # off the curve (a retraction's estimate): still exact
    for steps in (1, 30, 700):
        running.decay(steps)
        want = stepwise(want, steps, cfg)
        assert running.ratio == want
