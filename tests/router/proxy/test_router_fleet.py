"""`radixserve route` as a process in front of a fleet of worker processes (issue 6, acceptance 6):
a worker killed mid-load costs no non-streaming request, workers come and go at run time, and
streams pass through. Workers are identified by the router's own counters, not by their answers.

Worker processes come from `launch_worker`, which starts either kind and waits for its ready line:
`radixserve serve --sim tiny-cpu` workers (the real server, scheduler and radix cache with a
simulated runner) by default; RADIXSERVE_TEST_WORKER=fake starts tests/fake_worker.py instead.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("httptools")

from radixserve.router.proxy.workers import ConnectionPool  # noqa: E402

FAKE = Path(__file__).parents[2] / "fake_worker.py"  # tests/fake_worker.py
WORKER_KIND = os.environ.get("RADIXSERVE_TEST_WORKER", "sim")
START_TIMEOUT_S = 120.0


class Proc:
    """A child process in its own session (killing it kills its children too) whose output is
    drained by a thread, so that its logging never blocks it; `wait_line` finds a regex in it."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._new = threading.Condition()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            with self._new:
                self.lines.append(line)
                self._new.notify_all()
        with self._new:
            self._new.notify_all()

    def wait_line(self, pattern: str, timeout: float = START_TIMEOUT_S) -> re.Match[str]:
        deadline, regex, seen = time.monotonic() + timeout, re.compile(pattern), 0
        with self._new:
            while True:
                for line in self.lines[seen:]:
                    if m := regex.search(line):
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"no {pattern!r} in output:\n{''.join(self.lines[-50:])}")
                self._new.wait(min(left, 0.5))

    def kill(self) -> None:
        """SIGKILL, as a crash would: no chance to finish or close anything."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


class WorkerProc(Proc):
    url: str


def launch_worker(token_delay_ms: float = 2.0) -> WorkerProc:
    """Start one worker on a free loopback port; returns once it answers requests. Fake workers
    take `token_delay_ms` per generated token, so that requests are in flight when one dies."""
    if WORKER_KIND == "sim":
        cmd = [sys.executable, "-m", "radixserve", "serve", "--sim", "tiny-cpu", "--port", "0",
               "--log-level", "warning"]  # fmt: skip
        ready = r"serving \S+ on (http://\S+)"
    else:
        cmd = [sys.executable, str(FAKE), "--port", "0", "--token-delay-ms", str(token_delay_ms)]
        ready = r"READY (\d+)"
    worker = WorkerProc(cmd)
    found = worker.wait_line(ready).group(1)
    worker.url = found if found.startswith("http") else f"http://127.0.0.1:{found}"
    return worker


class RouterProc(Proc):
    """`python -m radixserve route --port 0 ...`; its address comes from its start-up log line."""

    def __init__(self, urls: list[str], *flags: str) -> None:
        cmd = [sys.executable, "-m", "radixserve", "route", "--port", "0", "--log-level", "info",
               "--worker-urls", *urls, *flags]  # fmt: skip
        super().__init__(cmd)
        self.addr = self.wait_line(r"routing on http://(\S+) to").group(1)

    def call(self, method: str, path: str, obj: object = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(self.addr, timeout=30)
        conn.request(method, path, None if obj is None else json.dumps(obj))
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
        conn.close()
        return status, json.loads(data) if data else {}

    def requests_per_worker(self) -> dict[str, int]:
        return {w["url"]: w["requests"] for w in self.call("GET", "/workers")[1]["workers"]}

    def metrics(self) -> dict[str, float]:
        """The router's /metrics as {"name@worker url": value} (other labels dropped)."""
        conn = http.client.HTTPConnection(self.addr, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        out = {}
        for line in text.splitlines():
            if m := re.match(r"radixserve_router_(\w+)(\{.*\})? (\S+)$", line):
                name, labels, value = m.groups()
                worker = re.search(r'worker="([^"]*)"', labels or "")
                out[f"{name}@{worker.group(1)}" if worker else name] = float(value)
        return out


@pytest.fixture
def fleet():
    """`fleet(n)` starts n workers; every process started through it is stopped at the end."""
    procs: list[Proc] = []

    def start(n: int) -> list[WorkerProc]:
        workers = [launch_worker() for _ in range(n)]
        procs.extend(workers)
        return workers

    def router(urls: list[str], *flags: str) -> RouterProc:
        procs.append(RouterProc(urls, *flags))
        return procs[-1]  # type: ignore[return-value]

    start.router = router  # type: ignore[attr-defined]
    yield start
    for proc in procs:
        proc.stop()


FAST_HEALTH = ("--health-check-interval-secs", "0.2", "--health-check-timeout-secs", "1",
               "--retry-backoff-ms", "5")  # fmt: skip


def body(i: int, groups: int = 6) -> bytes:
    """Requests of `groups` shared-prefix groups, so cache_aware spreads them over the fleet."""
    prefix = f"group {i % groups}: " + "a shared system prompt. " * 20
    return json.dumps({"text": prefix + f"question {i}", "sampling_params": {"max_new_tokens": 8},
                       "max_tokens": 8}).encode()  # fmt: skip


async def load(addr: str, n: int, concurrency: int, at: dict | None = None) -> list[int]:
    """Statuses of `n` non-streaming requests; `at[i]()` runs (in a thread) before request i."""
    pool, statuses, todo = ConnectionPool(f"http://{addr}"), [], iter(range(n))

    async def user() -> None:
        for i in todo:
            if at and i in at:
                await asyncio.to_thread(at[i])
            try:
                resp = await pool.request("POST", "/generate", body(i), timeout=60)
            except (ConnectionError, TimeoutError) as exc:
                statuses.append(type(exc).__name__)
                continue
            statuses.append(resp.status)
            if resp.status == 200:
                assert json.loads(resp.body)["text"]

    await asyncio.gather(*(user() for _ in range(concurrency)))
    pool.close()
    return statuses


def test_worker_killed_mid_load_costs_no_request(fleet):
    workers = fleet(3)
    router = fleet.router([w.url for w in workers], *FAST_HEALTH)
    statuses = asyncio.run(load(router.addr, 600, 16, at={200: workers[0].kill}))
    assert statuses == [200] * 600
    info = {w["url"]: w for w in router.call("GET", "/workers")[1]["workers"]}
    dead = info[workers[0].url]
    assert dead["errors"] >= 1  # it was serving when it died: its requests were retried
    assert not dead["healthy"] or dead["circuit"] == "open"
    before = router.requests_per_worker()
    assert asyncio.run(load(router.addr, 60, 4)) == [200] * 60
    after = router.requests_per_worker()
    assert after[workers[0].url] == before[workers[0].url]  # out of routing
    assert all(after[w.url] > before[w.url] for w in workers[1:])


def test_workers_added_and_removed_under_load(fleet):
    first, second = fleet(2)
    router = fleet.router([first.url], *FAST_HEALTH)

    def add() -> None:
        assert router.call("POST", "/workers", {"url": second.url})[0] == 201

    def remove() -> None:
        assert router.call("DELETE", "/workers/w1")[0] == 200

    statuses = asyncio.run(load(router.addr, 600, 8, at={150: add, 400: remove}))
    assert statuses == [200] * 600
    assert router.requests_per_worker().keys() == {second.url}
    assert router.requests_per_worker()[second.url] > 0
    assert asyncio.run(load(router.addr, 20, 2)) == [200] * 20
    assert router.call("GET", "/list_workers")[1]["urls"] == [second.url]
    assert router.call("POST", f"/add_worker?url={first.url}")[0] == 200
    assert router.call("POST", f"/remove_worker?url={second.url}")[0] == 200
    assert asyncio.run(load(router.addr, 20, 2)) == [200] * 20
    assert router.requests_per_worker() == {first.url: 20}


def read_events(addr: str, path: str, payload: dict) -> tuple[int, list[tuple[float, str]]]:
    """Status and the SSE `data:` payloads of one streamed request, with arrival times."""
    conn = http.client.HTTPConnection(addr, timeout=30)
    conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
    resp, t0, buf, events = conn.getresponse(), time.monotonic(), "", []
    ctype = resp.getheader("Content-Type", "")
    assert ctype.startswith("text/event-stream"), (resp.status, resp.read())
    while chunk := resp.read1(65536):
        buf += chunk.decode()
        *done, buf = buf.split("\n\n")
        events += [(time.monotonic() - t0, e[len("data: ") :]) for e in done if e.strip()]
    conn.close()
    return resp.status, events


def test_streams_pass_through_the_router(fleet):
    (worker,) = fleet(1)
    router = fleet.router([worker.url])
    model = router.call("GET", "/v1/models")[1]["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "stream": True, "ignore_eos": True}  # fmt: skip
    status, events = read_events(router.addr, "/v1/chat/completions", chat)
    assert status == 200 and events[-1][1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for _, e in events[:-1]]
    assert len(pieces) >= 8 and "".join(pieces)
    gen = {"text": "count", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
           "stream": True}  # fmt: skip
    status, events = read_events(router.addr, "/generate", gen)
    assert status == 200 and events[-1][1] == "[DONE]" and len(events) >= 8
    # Relayed as generated, not buffered: the events did not all arrive at once.
    assert events[-1][0] > events[0][0]


def test_the_router_runs_on_uvloop_where_it_installs(fleet):
    uvloop = pytest.importorskip("uvloop")  # a dependency wherever it installs
    r = fleet.router([])
    assert r.wait_line(r"\(event loop: (\w+)\)").group(1) == uvloop.__name__
