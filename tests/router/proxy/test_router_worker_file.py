"""`radixserve route --worker-file`: the file is re-read when it changes (as `epp`'s, llm-d's
file discovery); workers it adds take traffic, workers it drops leave, --worker-urls stay."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("httptools")

from test_router_fleet import FAST_HEALTH, RouterProc, launch_worker, load  # noqa: E402

pytestmark = pytest.mark.slow


def _wait(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _workers(router: RouterProc) -> dict[str, dict]:
    return {w["url"]: w for w in router.call("GET", "/workers")[1]["workers"]}


def test_route_follows_its_worker_file(tmp_path):
    workers = [launch_worker() for _ in range(3)]
    static, a, b = (w.url for w in workers)
    listing = tmp_path / "workers.txt"
    listing.write_text(f"{a}\n")
    router = RouterProc([static], "--worker-file", str(listing), "--policy", "round_robin",
                        *FAST_HEALTH)  # fmt: skip
    healthy = lambda: {u for u, w in _workers(router).items() if w["healthy"]}  # noqa: E731
    try:
        _wait(lambda: healthy() == {static, a}, "the file's worker joins the static one")
        listing.write_text(f"# both now\n{a}\n{b}\n")
        _wait(lambda: healthy() == {static, a, b}, "a worker the file adds joins")
        before = router.requests_per_worker()
        assert asyncio.run(load(router.addr, 9, 3)) == [200] * 9
        after = router.requests_per_worker()
        assert all(after[u] > before.get(u, 0) for u in (static, a, b))
        listing.write_text(f"{b}\n")
        _wait(lambda: set(_workers(router)) == {static, b}, "a worker the file drops leaves")
    finally:
        for proc in (router, *workers):
            proc.stop()
