"""The router's own endpoints besides proxying: probes, loads, worker management, model list,
cache flush and metrics. A mixin of Router (app.py), which owns the registry and policy."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote

from prometheus_client import generate_latest

from radixserve.router.http import Request, error_body
from radixserve.router.worker_kinds import FLUSH, KINDS, flush_failure, http_get, parse_kv_events
from radixserve.router.workers import DuplicateWorker, Response, fan_out, resolve

try:  # 5x faster on long prompts; the stdlib parser is the fallback
    from orjson import loads
except ImportError:  # pragma: no cover
    from json import loads

if TYPE_CHECKING:
    from radixserve.router.app import Router


class Text(str):
    """A handler's plain-text answer (Prometheus exposition format)."""


class Endpoints:
    """Handlers: each takes the request and returns (status, JSON-able object or Text)."""

    async def liveness(self: Router, req: Request) -> tuple[int, object]:
        return 200, {"status": "ok"}

    async def readiness(self: Router, req: Request) -> tuple[int, object]:
        ready = self.registry.routable()
        return (200 if ready else 503), {
            "status": "ok" if ready else "no healthy worker",
            "healthy_workers": ready,
        }

    async def get_loads(self: Router, req: Request) -> tuple[int, object]:
        now, pending = time.monotonic(), getattr(self.policy, "pending", None)
        rows = []
        for w in self.registry.workers:
            row = {"id": w.id, "url": w.url, "load": w.load, "healthy": w.healthy}
            if pending is not None:  # kv_aware: prefill the worker reported, and the total
                row["reported_prefill_tokens"] = w.prefill_tokens
                row["pending_prefill_tokens"] = pending(w.view(now))
            rows.append(row)
        return 200, {"workers": rows}

    async def list_workers(self: Router, req: Request) -> tuple[int, object]:
        workers = self.registry.workers
        rows = [{**w.info(), **self.kinds.info(w.id)} for w in workers]
        return 200, {"workers": rows, "urls": [w.url for w in workers]}

    async def add_worker(self: Router, req: Request) -> tuple[int, object]:
        """Register a worker; it takes traffic once its first health probe passes (and, with
        kv_aware, once its tokenizer is checked and its KV events subscribed to). Optional
        ``type`` (radixserve, vllm, sglang; default: --worker-type) and ``kv_events``
        (``{"endpoint", "replay_endpoint", "topic"}``: where it publishes, if not where it says)."""
        body = _json(req) if req.body else {}
        unknown = sorted(set(body) - {"url", "type", "kv_events"})
        if unknown:  # nothing a client sets is silently ignored
            return 400, error_body(
                400, f"unknown field(s) {', '.join(unknown)}: accepted are url, type, kv_events"
            )
        url = _query(req, "url") or body.get("url")
        if not isinstance(url, str) or not url:
            return 400, error_body(400, 'give the worker as ?url= or a JSON body {"url": ...}')
        kind = body.get("type")
        if kind is not None and kind not in KINDS:
            return 400, error_body(400, f"type must be one of {', '.join(KINDS)}, not {kind!r}")
        try:
            override = parse_kv_events(body["kv_events"]) if "kv_events" in body else None
            worker = self.registry.add(url, await resolve(url), healthy=False)
        except ValueError as exc:
            status = 409 if isinstance(exc, DuplicateWorker) else 400
            return status, error_body(status, str(exc))
        self.kinds.register(worker.id, worker.url, kind, override)
        if not await self.admit(worker):  # kv_aware: checked before it can take traffic
            why = self.kv.refused.get(worker.url, "refused") if self.kv else "refused"
            return 409, error_body(409, f"worker {url} refused: {why}")
        await self.registry.probe_now(worker)
        return 201 if req.path == "/workers" else 200, {
            **worker.info(),
            **self.kinds.info(worker.id),
        }

    async def remove_worker(self: Router, req: Request) -> tuple[int, object]:
        ref = (
            unquote(req.path[len("/workers/") :]) if req.method == "DELETE" else _query(req, "url")
        )
        worker = self.registry.get(ref) if ref else None
        if worker is None:
            return 404, error_body(404, f"no worker {ref!r}")
        self.registry.remove(worker)
        self.kinds.forget(worker.id)
        if self.kv is not None:
            await self.kv.forget(worker.id)
        return 200, {"removed": worker.id, "url": worker.url}

    async def models(self: Router, req: Request) -> tuple[int, object]:
        routable = [w for w in self.registry.workers if w.view(time.monotonic()).healthy]
        headers = self._forward_headers(req)
        for reply in await fan_out(routable, "GET", "/v1/models", headers):
            if isinstance(reply, Response) and reply.status == 200:
                return 200, loads(reply.body)
        return 503, error_body(503, "no healthy worker answered /v1/models")

    async def flush_cache(self: Router, req: Request) -> tuple[int, object]:
        """Flush every worker's prefix cache, each the way its kind does (vLLM:
        /reset_prefix_cache), and forget what the router believed they held."""
        workers, headers = self.registry.workers, self._forward_headers(req)
        auth = self._worker_auth()
        await asyncio.gather(*(self.kinds.identify(w.id, w.url, http_get(w.pool.request, auth))
                               for w in workers))  # fmt: skip
        calls = []
        for w in workers:
            method, path = FLUSH.get(self.kinds.state(w.id).kind or "", FLUSH["radixserve"])
            calls.append(w.pool.request(method, path, timeout=30.0, headers=headers))
        replies = await asyncio.gather(*calls, return_exceptions=True)
        results = {w.url: getattr(r, "status", str(r)) for w, r in zip(workers, replies)}
        for worker in workers:  # their caches are empty now: so must the router's belief be
            self.policy.on_worker_removed(worker.id)
        ok = all(s == 200 for s in results.values())
        body: dict[str, object] = {"success": ok, "workers": results}
        failed = {w.url: flush_failure(self.kinds.state(w.id).kind, s)
                  for w, s in zip(workers, results.values()) if isinstance(s, int) and s != 200}  # fmt: skip
        if failed:
            body["errors"] = failed
        return (200 if ok else 502), body

    async def metrics(self: Router, req: Request) -> tuple[int, object]:
        return 200, Text(generate_latest(self.metrics_registry).decode())


def _query(req: Request, name: str) -> str | None:
    values = parse_qs(req.query).get(name)
    return values[0] if values else None


def _json(req: Request) -> dict:
    try:
        obj = loads(req.body)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}
