"""--enable-trace on `serve`: a span per generation request (continuing the caller's W3C
traceparent, a router's say), whose traceparent goes with the request to the scheduler process,
where the queue, prefill and decode spans are recorded under it."""

from __future__ import annotations

from typing import Any

from radixserve.engine.tokenizer_manager import TRACEPARENT
from radixserve.tracing import Tracer

TRACED = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/messages"})


class TraceMiddleware:
    """Pure ASGI: one `radixserve.serve.request` span per POST to a generation route, ended once
    the response (a stream's last byte included) has gone."""

    def __init__(self, app: Any, tracer: Tracer) -> None:
        self.app, self.tracer = app, tracer

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in TRACED:
            return await self.app(scope, receive, send)
        parent = dict(scope["headers"]).get(b"traceparent", b"").decode("latin-1") or None
        rid = scope.get("state", {}).get("request_id", "")
        attrs = {"http.request.method": "POST", "url.path": scope["path"],
                 "radixserve.request_id": rid}  # fmt: skip
        span = self.tracer.start("radixserve.serve.request", parent, "server", attrs)

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        token = TRACEPARENT.set(self.tracer.traceparent(span))
        try:
            await self.app(scope, receive, send_status)
        finally:
            TRACEPARENT.reset(token)
            span.end()
