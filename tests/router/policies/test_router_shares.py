"""Decayed dispatch counts (router/shares.py): decay, rescaling, and where a worker that joins or
returns starts."""

from __future__ import annotations

import pytest

from radixserve.router.policies.shares import DispatchShares


def test_counts_decay_with_each_dispatch_and_survive_rescaling() -> None:
    shares = DispatchShares(window=100)
    shares.observe(["a", "b"])
    shares.record("a")
    for _ in range(100):
        shares.record("b")
    assert shares.count("a") == pytest.approx(0.99**101, rel=1e-9)  # 101 dispatches ago
    for _ in range(30_000):  # far past the point where the internal unit is rescaled
        shares.record("b")
    assert shares.count("b") == pytest.approx(99.0, rel=1e-3)  # 0.99 / (1 - 0.99)
    assert shares.excess("b", ["a", "b"])[0] == pytest.approx(49.5, rel=1e-3)


def test_a_new_or_long_gone_worker_starts_at_the_mean_a_brief_absence_changes_nothing() -> None:
    shares = DispatchShares(window=1600)
    shares.observe(["a", "b"])
    for i in range(300):
        shares.record("a" if i % 3 else "b")
    shares.observe(["a", "b", "c"])  # c joins: as busy as the average, not idle
    mean = (shares.count("a") + shares.count("b")) / 2
    assert shares.count("c") == pytest.approx(mean)
    b_before = shares.count("b")
    shares.observe(["a", "c"])  # b excluded for one retry
    shares.record("a")
    shares.observe(["a", "b", "c"])
    assert shares.count("b") == pytest.approx(b_before * (1 - 1 / 1600))  # not reset
    shares.observe(["a", "c"])
    for _ in range(200):  # b away for longer than window / 16 dispatches
        shares.record("a")
        shares.observe(["a", "c"])
    shares.observe(["a", "b", "c"])
    assert shares.count("b") == pytest.approx((shares.count("a") + shares.count("c")) / 2)
    shares.forget("b")
    assert shares.count("b") == 0.0
