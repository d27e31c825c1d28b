"""The async load generator: sends a workload's requests at their arrival times (open loop) or
at most N at once (closed loop), streams every answer and times each token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from radixserve.bench.backends import Backend, parse_sse_line
from radixserve.sim.workloads import Chains, WorkloadRequest, render_text


@dataclass(slots=True)
class LoadConfig:
    base_url: str
    backend: Backend
    model: str | None = None
    max_concurrency: int | None = None  # None: send at the workload's arrival times
    timeout_s: float = 600.0
    api_key: str | None = None
    progress: bool = True


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds from the start of the run."""

    rid: str
    prompt_len: int  # token ids of the workload's prompt
    sent: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list, repr=False)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them, when it reports usage
    cached_tokens: int | None = None
    error: str | None = None
    ended: float | None = None  # when the request ended, answered or failed

    @property
    def ok(self) -> bool:
        return self.error is None


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise RuntimeError("radixserve bench needs httpx: pip install httpx") from None
    return httpx


async def run_load(requests: Sequence[WorkloadRequest], cfg: LoadConfig) -> list[RequestRecord]:
    """Send every request; a chat turn goes out only after its previous turn's answer (plus the
    think time the workload planned between them). Returns one record per request, in order."""
    httpx = _import_httpx()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limit = cfg.max_concurrency or 1024
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(
        base_url=cfg.base_url, timeout=cfg.timeout_s, limits=limits, headers=headers
    ) as client:
        if cfg.model is None and cfg.backend.path.startswith("/v1/"):
            cfg.model = await served_model(client)
        return await _Run(client, requests, cfg).all()


async def served_model(client: Any) -> str | None:
    """The first model that /v1/models lists (OpenAI servers check the name), else None."""
    try:
        resp = await client.get("/v1/models")
        return resp.json()["data"][0]["id"]
    except Exception:  # noqa: BLE001 - no listing: send no name and let the server decide
        return None


class _Run:
    def __init__(self, client: Any, requests: Sequence[WorkloadRequest], cfg: LoadConfig) -> None:
        self.client, self.reqs, self.cfg = client, list(requests), cfg
        self.records = [RequestRecord(r.rid, len(r.input_ids)) for r in self.reqs]
        self.chains = Chains(self.reqs)
        self.sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.tasks: set[asyncio.Task] = set()
        self.start = 0.0

    async def all(self) -> list[RequestRecord]:
        self.start = time.perf_counter()
        closed = self.cfg.max_concurrency is not None
        with tqdm(total=len(self.reqs), unit="req", disable=not self.cfg.progress) as bar:
            self.bar = bar
            for i in self.chains.roots:
                self._spawn(i, 0.0 if closed else self.reqs[i].arrival_s)
            while self.tasks:
                done, _ = await asyncio.wait(set(self.tasks))
                self.tasks -= done
                for t in done:
                    t.result()  # a bug in here must not pass silently
        return self.records

    def _spawn(self, i: int, at: float) -> None:
        self.tasks.add(asyncio.get_running_loop().create_task(self._one(i, at)))

    async def _one(self, i: int, at: float) -> None:
        delay = at - (time.perf_counter() - self.start)
        if delay > 0:
            await asyncio.sleep(delay)
        if self.sem is None:
            await self._send(i)
        else:
            async with self.sem:
                await self._send(i)
        self.bar.update(1)
        now = time.perf_counter() - self.start
        for j, think in self.chains.after(i):
            self._spawn(j, now + think)

    async def _send(self, i: int) -> None:
        req, rec, cfg = self.reqs[i], self.records[i], self.cfg
        body = cfg.backend.body(render_text(req.input_ids), req.output_len, cfg.model)
        t0 = time.perf_counter()
        rec.sent = t0 - self.start
        try:
            await self._exchange(body, rec, t0)
        finally:  # a failed request counts in the run's duration too
            rec.ended = time.perf_counter() - self.start

    async def _exchange(self, body: dict[str, Any], rec: RequestRecord, t0: float) -> None:
        try:
            async with self.client.stream("POST", self.cfg.backend.path, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:200]
                    rec.error = f"HTTP {resp.status_code}: {text}"
                    return
                await self._read(resp, rec, t0)
        except Exception as e:  # noqa: BLE001 - any failure of one request is recorded
            rec.error = f"{type(e).__name__}: {e}"
            return
        rec.e2e = time.perf_counter() - t0
        if rec.ttft is None:
            rec.error = "no tokens in the response"

    async def _read(self, resp: Any, rec: RequestRecord, t0: float) -> None:
        backend, so_far, last, events, reported = self.cfg.backend, "", t0, 0, None
        async for line in resp.aiter_lines():
            obj = parse_sse_line(line)
            if obj is None or obj == "[DONE]":
                continue
            ev = backend.parse(obj)  # type: ignore[arg-type]
            text = ev.text
            if backend.path == "/generate":  # cumulative text: the new part is the tail
                text, so_far = ev.text[len(so_far) :], ev.text
            if text:
                now = time.perf_counter()
                if rec.ttft is None:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last, events = now, events + 1
            rec.prompt_tokens = _first(ev.prompt_tokens, rec.prompt_tokens)
            rec.cached_tokens = _first(ev.cached_tokens, rec.cached_tokens)
            reported = _first(ev.completion_tokens, reported)
        rec.output_tokens = reported if reported is not None else events


def _first(new: int | None, old: int | None) -> int | None:
    return new if new is not None else old
