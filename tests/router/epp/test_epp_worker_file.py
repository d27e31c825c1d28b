"""`radixserve epp --worker-file`: the worker file is re-read when it changes; workers it adds
take traffic, workers it drops leave, a malformed version changes nothing; a real Envoy's pool
follows, through the EDS file the EPP keeps (--endpoints-file)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("grpc")

from envoy_harness import EnvoyProc, EppProc, get  # noqa: E402
from test_router_fleet import FAST_HEALTH, launch_worker  # noqa: E402

pytestmark = pytest.mark.slow


def _urls(epp: EppProc, healthy: bool = True) -> set[str]:
    workers = json.loads(get(epp.addr, "/workers")[1])["workers"]
    return {w["url"] for w in workers if w["healthy"] or not healthy}


def _wait(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_the_worker_file_is_followed_as_it_changes(tmp_path):
    pytest.importorskip("envoy")
    workers = [launch_worker() for _ in range(2)]
    listing = tmp_path / "workers.txt"
    listing.write_text(f"# the pool\n{workers[0].url}\n")
    epp = EppProc([], "--worker-file", str(listing), *FAST_HEALTH)
    procs = [epp, *workers]
    try:
        envoy = EnvoyProc(epp, tmp_path)
        procs.insert(0, envoy)
        a, b = workers[0].url, workers[1].url
        ea, eb = a.removeprefix("http://"), b.removeprefix("http://")
        _wait(lambda: _urls(epp) == {a}, "the first worker joins from the file")
        _wait(lambda: envoy.hosts() == {ea}, "Envoy's pool has it from the endpoints file")
        listing.write_text(json.dumps({"endpoints": [a, eb]}))
        _wait(lambda: _urls(epp) == {a, b}, "the second joins when the file changes")
        _wait(lambda: envoy.hosts() == {ea, eb}, "and Envoy's pool with it")
        listing.write_text("{not json")
        time.sleep(2.5)  # read and refused: both stay
        assert _urls(epp) == {a, b}
        assert any("worker file" in line and "unchanged" in line for line in epp.lines)
        listing.write_text(b + "\n")
        _wait(lambda: _urls(epp, healthy=False) == {b}, "the first leaves when the file drops it")
        _wait(lambda: envoy.hosts() == {eb}, "and Envoy's pool without it")
    finally:
        for proc in procs:
            proc.stop()
