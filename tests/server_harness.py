"""`radixserve serve` as a child process for the HTTP tests: start it, read the address it prints,
talk to it over plain HTTP (as curl would), and stop it, checking that no process outlives it."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# small limits, so that the refusals they cause are cheap to reach
TINY_SERVER_ARGS = ("--max-total-tokens", "4096", "--context-length", "128",
                    "--max-payload-size", "65536", "--max-batch-size", "8")  # fmt: skip

READY = re.compile(r"radixserve: serving (\S+) on (http://\S+)")
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The ``data:`` payloads of a server-sent-event body, in order."""
        out = []
        for block in self.body.decode().split("\n\n"):
            if block.strip():
                assert block.startswith("data: "), block
                out.append(block[len("data: ") :])
        return out


class ServerProcess:
    """One `python -m radixserve serve ... --port 0`; its output is kept for failure reports."""

    def __init__(
        self, args: Sequence[str], start_timeout: float = START_TIMEOUT_S,
        prefix: Sequence[str] = (),
    ) -> None:  # fmt: skip
        """``prefix``: a command that execs the server (``taskset -c 0``: pinned to a core)."""
        cmd = [*prefix, sys.executable, "-m", "radixserve", "serve", "--port", "0",
               "--log-level", "warning", *args]  # fmt: skip
        # a temporary directory of its own, to see that the engine's IPC sockets are removed
        self.tmp = tempfile.TemporaryDirectory(prefix="radixserve-test-")
        env = {**os.environ, "TMPDIR": self.tmp.name}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.name = self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(start_timeout) or not self.url:
            self.stop(check=False)
            raise RuntimeError("the server did not start:\n" + self.output())
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80

    def _read(self) -> None:
        # keeps draining the pipe for the server's whole life, so that logging never blocks it
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.name, self.url = m.group(1), m.group(2)
                self._ready.set()
        self._ready.set()

    def output(self) -> str:
        return "".join(self.lines[-200:])

    def errors(self, since: int = 0) -> list[str]:
        """Lines the server logged at ERROR (or tracebacks) from line ``since`` on."""
        return [s for s in self.lines[since:] if " ERROR " in s or s.startswith("Traceback")]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tree(self) -> list[int]:
        """The server's pid and every descendant's."""
        return process_tree(self.pid)

    def request(
        self, method: str, path: str, body: bytes | str | dict | None = None,
        headers: dict[str, str] | None = None, timeout: float = 60.0,
    ) -> Reply:  # fmt: skip
        """One request on a fresh connection; a dict body is sent as JSON, bytes as they are."""
        if isinstance(body, dict):
            body = json.dumps(body)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            headers = {k.lower(): v for k, v in resp.getheaders()}
            return Reply(resp.status, headers, resp.read())
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw: Any) -> Reply:
        # curl -d sends this content type; the server must read the JSON all the same
        headers = {"Content-Type": "application/x-www-form-urlencoded", **kw.pop("headers", {})}
        return self.request("POST", path, body, headers, **kw)

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def stats(self) -> dict[str, Any]:
        reply = self.get("/get_server_info")
        assert reply.status == 200, reply
        return reply.json()["stats"]

    def wait_idle(self, timeout: float = 15.0) -> dict[str, Any]:
        """The scheduler's stats once nothing runs or waits."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if st["num_running"] == 0 and st["num_waiting"] == 0:
                return st
            assert time.monotonic() < deadline, st
            time.sleep(0.05)

    def stop(self, check: bool = True, sig: int = signal.SIGTERM) -> None:
        """Signal the server and wait. With ``check``: it exits with 0, and every process and
        file it made is gone."""
        running = self.proc.poll() is None
        pids = self.tree() if running else [self.pid]
        if running:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(STOP_TIMEOUT_S)
        left = wait_gone(pids, STOP_TIMEOUT_S)
        for pid in left:  # never leave them behind, even when the check fails
            _kill(pid)
        files = os.listdir(self.tmp.name)
        self.tmp.cleanup()
        if check:
            assert code == 0, f"the server exited with {code}:\n{self.output()}"
            assert not left, f"processes outlived the server: {left}\n{self.output()}"
            assert not files, f"the server left files behind: {files}"


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first), or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        fields = _stat(int(name)) if name.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")  # a zombie has exited


def wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time the live processes ``pids`` have used so far."""
    ticks = 0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def assert_error_body(reply: Reply, status: int | None = None) -> dict[str, Any]:
    """A 4xx whose body is OpenAI's ``{"error": {message, type, param, code}}``."""
    assert 400 <= reply.status < 500, (reply.status, reply.body[:500])
    if status is not None:
        assert reply.status == status, (reply.status, reply.body[:500])
    assert reply.headers.get("content-type", "").startswith("application/json"), reply.headers
    err = reply.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert isinstance(err["code"], str) and err["code"]
    assert "param" in err
    return err
