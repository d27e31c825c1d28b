"""The kv-indexer's HTTP face: health, Prometheus metrics, and the router's worker-admin
endpoints (same paths, bodies and answers as `radixserve route`)."""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from radixserve.router.indexer.metrics import metric_lines
from radixserve.router.indexer.service import Indexer
from radixserve.router.proxy.connections import error_body


def admin_app(indexer: Indexer, admin_api_key: str | None) -> FastAPI:
    """Health, metrics and worker management, in the router's shapes."""
    app = FastAPI(title="radixserve kv-indexer", openapi_url=None)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse(error_body(status, message), status_code=status)

    def denied(request: Request) -> JSONResponse | None:
        key = admin_api_key
        got = request.headers.get("authorization", "").encode()
        if key is None or hmac.compare_digest(got, b"Bearer " + key.encode()):
            return None
        return error(401, "missing or wrong API key")

    @app.get("/health")
    @app.get("/liveness")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "redis": indexer.writer.redis_ok, "workers": len(indexer.followed)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("\n".join(metric_lines(indexer)) + "\n")

    @app.get("/workers")
    @app.get("/list_workers")
    async def list_workers(request: Request) -> Any:
        if bad := denied(request):
            return bad
        workers = list(indexer.followed.values())
        return {"workers": [w.info() for w in workers], "urls": [w.url for w in workers]}

    @app.post("/workers")
    @app.post("/add_worker")
    async def add_worker(request: Request) -> Any:
        if bad := denied(request):
            return bad
        url, problem = await _url_of(request)
        if problem:
            return error(400, problem)
        try:
            worker = indexer.add(url)
        except ValueError as exc:
            return error(409 if "already" in str(exc) else 400, str(exc))
        status = 201 if request.url.path == "/workers" else 200
        return JSONResponse(worker.info(), status_code=status)

    @app.post("/remove_worker")
    @app.delete("/workers/{ref:path}")
    async def remove_worker(request: Request, ref: str = "") -> Any:
        if bad := denied(request):
            return bad
        url = ref or request.query_params.get("url", "")
        worker = await indexer.remove(url) if url else None
        if worker is None:
            return error(404, f"no worker {url!r}")
        return {"removed": worker.url, "url": worker.url}

    return app


async def _url_of(request: Any) -> tuple[str, str]:
    """The worker URL of an add request (?url= or {"url": ...}), or why there is none."""
    url = request.query_params.get("url")
    body = await request.body()
    if url is None and body:
        try:
            obj = json.loads(body)
        except ValueError:
            return "", "request body is not JSON"
        if not isinstance(obj, dict):
            return "", 'give the worker as ?url= or a JSON body {"url": ...}'
        unknown = sorted(set(obj) - {"url"})
        if unknown:
            return "", f"unknown field(s) {', '.join(unknown)}: only url is accepted"
        url = obj.get("url")
    if not isinstance(url, str) or not url:
        return "", 'give the worker as ?url= or a JSON body {"url": ...}'
    return url, ""
