"""What the fleet benchmarks share: a router process (`radixserve route` or smg) in front of
engines, plain HTTP calls and streamed completions against it, and the multi-turn loop that
sends every conversation as it stands and appends what each turn added."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _machine import stop_process

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from vllm_harness import free_port  # noqa: E402


class Router:
    """`radixserve route --policy POLICY` or `smg launch --policy cache_aware` on a free port;
    with ``pd`` (prefill URL, its bootstrap port, decode URL) `radixserve route
    --pd-disaggregation` in front of that pair instead of ``urls``."""

    def __init__(
        self, policy: str, urls: list[str], smg: str = "", pd: tuple[str, int, str] | None = None
    ) -> None:
        self.policy, port = policy, free_port()
        self.host, self.port, self.workers = "127.0.0.1", port, len(urls)
        common = ["--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(port)]
        if pd is not None:
            common = ["--pd-disaggregation", "--prefill", pd[0], str(pd[1]), "--decode", pd[2],
                      *common[len(urls) + 1 :]]  # fmt: skip
        if policy == "smg":
            metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
            cmd = [smg, "launch", *common, "--policy", "cache_aware", *metrics]
            cmd += ["--log-level", "warn"]
            ready = "/health"
        else:
            cmd = [sys.executable, "-m", "radixserve", "route", *common, "--policy", policy]
            cmd += ["--log-level", "warning", "--health-check-interval-secs", "1"]
            ready = "/liveness"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)  # fmt: skip
        self._wait(lambda: call(self.port, "GET", ready)[0] == 200, f"{policy} ready")
        if policy == "kv_aware":  # every publisher followed before the first request
            self._wait(self._following, "kv_aware following every worker's KV events")

    def _following(self) -> bool:
        status, body = call(self.port, "GET", "/metrics")
        lines = body.decode().splitlines() if status == 200 else []
        on = [ln for ln in lines if ln.startswith("radixserve_router_worker_kv_events_following")]
        return len(on) == self.workers and all(ln.endswith(" 1.0") for ln in on)

    def _wait(self, check: Any, what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"{self.policy} exited: {err[-2000:]}")
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"timed out waiting for {what}")

    def stop(self) -> None:
        stop_process(self.proc)


def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def sse_events(port: int, path: str, body: dict, timeout_s: float = 300.0) -> Iterator[dict]:
    """POST ``body`` to a streaming endpoint; each server-sent ``data:`` event, parsed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{path} answered {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                yield json.loads(line[5:])
    finally:
        conn.close()


@dataclass
class Streamed:
    """One streamed completion: seconds to the first generated text or tool-call fragment,
    the text, the finish reason and the usage the server reported (``include_usage``)."""

    ttft: float
    text: str = ""
    finish: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def stream(port: int, path: str, body: dict) -> Streamed:
    """POST a streamed completion (usage asked for in the last event) and time it."""
    t0 = time.perf_counter()
    ttft, parts, finish, usage = None, [], None, {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    for event in sse_events(port, path, body):
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            delta = choice.get("delta") or {}
            text = choice.get("text") or delta.get("content") or ""
            if (text or delta.get("tool_calls")) and ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(text)
            finish = choice.get("finish_reason") or finish
    got = ttft if ttft is not None else time.perf_counter() - t0
    return Streamed(got, "".join(parts), finish, usage)


Chat = list[dict[str, Any]]


def run_turns(
    port: int, pool: ThreadPoolExecutor, chats: list[Chat], turns: int,
    body: Callable[[Chat], dict], extend: Callable[[int, Chat, Streamed, int], None],
) -> list[Streamed]:  # fmt: skip
    """`turns` waves over `chats`: each chat sent as it stands (``body(messages)``, streamed to
    /v1/chat/completions), then ``extend(chat index, chat, reply, turn)`` appends what the turn
    added; every reply, in the order sent."""
    out: list[Streamed] = []
    for turn in range(turns):
        send = lambda m: stream(port, "/v1/chat/completions", body(m))  # noqa: E731
        replies = list(pool.map(send, [list(m) for m in chats]))
        for c, reply in enumerate(replies):
            extend(c, chats[c], reply, turn)
        out += replies
    return out
