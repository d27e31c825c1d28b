"""The playground's HTTP face: the page and its static files, a JSON API over the simulator
(sweeps streamed one point per line, so the page can show progress) and the fleet snapshot."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from radixserve.playground import fleet, runs, trace
from radixserve.playground.params import ParamError, Params, describe, parse
from radixserve.sim.workload_args import finite

STATIC = Path(__file__).with_name("static")


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = HTTPStatus(status).phrase.lower().replace(" ", "_")  # a string, as the server's
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


async def _params(request: Request) -> Params:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise ParamError("body", f"the body is not valid JSON: {e}") from None
    return parse(body)


def _ndjson(points: Iterator[dict[str, Any]], total: int) -> StreamingResponse:
    """One JSON line per finished point ({"done", "total", "point"}): the page's progress bar."""

    def lines() -> Iterator[bytes]:
        for i, point in enumerate(points, 1):
            doc = {"done": i, "total": total, "point": finite(point)}
            yield (json.dumps(doc) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def create_app(router_url: str | None = None) -> FastAPI:
    """The playground; with ``router_url`` also the fleet view of that router."""
    app = FastAPI(title="radixserve playground", docs_url=None, redoc_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.exception_handler(ParamError)
    async def bad_param(_: Request, e: ParamError) -> JSONResponse:
        return error(400, str(e), e.param)

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/settings")
    async def settings() -> dict[str, Any]:
        return finite(
            {
                "settings": describe(),
                "curve_probs": runs.CURVE_PROBS,
                "curve_policies": runs.CURVE_POLICIES,
                "wait_sweep_ms": runs.WAIT_SWEEP_MS,
                "fleet": router_url,
            }
        )

    @app.post("/api/compare")
    async def compare(request: Request) -> dict[str, Any]:
        p = await _params(request)
        return finite({"results": await run_in_threadpool(runs.compare, p)})

    @app.post("/api/curve")
    async def curve(request: Request) -> StreamingResponse:
        return _ndjson(runs.curve(await _params(request)), runs.total_points("curve"))

    @app.post("/api/tradeoff")
    async def tradeoff(request: Request) -> StreamingResponse:
        return _ndjson(runs.tradeoff(await _params(request)), runs.total_points("tradeoff"))

    @app.post("/api/trace")
    async def walk(request: Request) -> dict[str, Any]:
        p = await _params(request)
        return finite(await run_in_threadpool(trace.walk_all, p.policies))

    _add_fleet(app, router_url)
    return app


def _add_fleet(app: FastAPI, router_url: str | None) -> None:
    client: Callable[[], httpx.AsyncClient] = lambda: httpx.AsyncClient(timeout=3.0)  # noqa: E731

    @app.get("/api/fleet")
    async def fleet_view() -> Any:
        if router_url is None:
            return error(404, "no fleet: start the playground with --router-url URL", "router_url")
        async with client() as c:
            try:
                return finite(await fleet.snapshot(c, router_url))
            except (httpx.HTTPError, ValueError) as e:
                return error(502, f"router {router_url} did not answer: {e}", "router_url")
