"""What the server adds around its routes: /docs and /openapi.json behind --api-key like every
other non-probe endpoint, and the X-Request-Id of each request (the client's, e.g. forwarded by
the router, or a fresh one) echoed in its answer and logged, so one request can be followed
across the router's log and the worker's."""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from radixserve.server.state import ServerState

log = logging.getLogger("radixserve.server")


def add_docs(app: FastAPI, state: ServerState) -> None:
    """/openapi.json and /docs, with the API key when the server has one (FastAPI's own pair is
    turned off by create_app)."""
    guard = [Depends(state.authorize)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=guard)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guard)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")


class RequestIdMiddleware:
    """Pure ASGI (cheaper than BaseHTTPMiddleware): reads or makes the request id, logs it and
    puts it on the response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        rid = given if 0 < len(given) <= 128 and given.isascii() else os.urandom(12).hex().encode()
        scope.setdefault("state", {})["request_id"] = rid.decode()
        log.info("request %s: %s %s", rid.decode(), scope["method"], scope["path"])

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)
