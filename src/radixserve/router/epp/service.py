"""The ext_proc service: one gRPC stream per HTTP request, its body buffered to the end
(FULL_DUPLEX_STREAMED), one pick, the pick in a header and in `envoy.lb` dynamic metadata,
the body streamed back unchanged; gRPC health for liveness and readiness."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixserve.router.epp import protocol as p

log = logging.getLogger("radixserve.epp")
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(slots=True)
class Pick:
    """A picker's answer: an endpoint (`host:port`), the fallbacks a proxy's retry goes to
    when it fails (in order), and the picker's own handle for `done`; or no endpoint and the
    HTTP status and message to answer with. `headers` are set on the request Envoy sends on
    (e.g. the traceparent that joins the engine's spans to the pick's)."""

    endpoint: str | None
    handle: Any = None
    fallbacks: list[str] = field(default_factory=list)
    status: int = 503
    message: str = ""
    headers: dict[str, str] = field(default_factory=dict)


class Picker(Protocol):
    """What the service needs of whoever picks (radixserve's router, wired by `radixserve epp`)."""

    async def pick(
        self, body: bytes, path: str, allowed: set[str] | None, traceparent: str | None
    ) -> Pick: ...

    def done(self, handle: Any, status: int | None, served: str | None) -> None: ...

    def ready(self) -> bool: ...


class Stream:
    """One request's ext_proc stream: what has arrived so far and what was picked."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.pick: Pick | None = None
        self.status: int | None = None
        self.served: str | None = None
        self.allowed: set[str] | None = None  # the subset hint, from whichever message has it


class EndpointPicker:
    """The ExternalProcessor servicer (grpc.aio) over a Picker."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.decisions = 0

    async def Process(  # noqa: N802  (the gRPC method's name)
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        state = Stream()
        try:
            async for request in requests:
                for answer in await self._answer(state, request):
                    yield answer
        finally:
            if state.pick is not None and state.pick.endpoint is not None:
                self.picker.done(state.pick.handle, state.status, state.served)

    async def _answer(self, state: Stream, request: Any) -> list[Any]:
        kind = request.WhichOneof("request")
        if request.HasField("metadata_context") and (allowed := p.subset(request)) is not None:
            state.allowed = allowed
        if kind == "request_headers":
            state.headers = p.header_map(request.request_headers.headers)
            if not request.request_headers.end_of_stream:
                return []  # the answer waits for the whole body
            return await self._picked(state, with_body=False)
        if kind == "request_body":
            state.body += request.request_body.body
            if not request.request_body.end_of_stream:
                return []
            return await self._picked(state, with_body=True)
        if kind == "response_headers":
            headers = p.header_map(request.response_headers.headers)
            state.status = int(headers.get(":status", "0")) or None
            state.served = p.served(request, headers)
            return [p.headers_continue(response=True)]
        if kind in ("request_trailers", "response_trailers"):
            return [p.trailers_continue(response=kind == "response_trailers")]
        return [p.pb.ProcessingResponse(response_body=p.pb.BodyResponse())]

    async def _picked(self, state: Stream, with_body: bool) -> list[Any]:
        path = state.headers.get(":path", "").split("?", 1)[0]
        trace = state.headers.get("traceparent")
        state.pick = pick = await self.picker.pick(bytes(state.body), path, state.allowed, trace)
        self.decisions += 1
        if pick.endpoint is None:
            kind = "rate_limit_exceeded" if pick.status == 429 else "service_unavailable"
            return [p.immediate(pick.status, pick.message, kind)]
        endpoints = [pick.endpoint, *pick.fallbacks]
        answers = p.picked(endpoints, bytes(state.body), pick.headers)
        return answers if with_body else answers[:1]


async def start_grpc(
    picker: Picker, host: str, port: int, ready_every: float = 1.0
) -> tuple[grpc.aio.Server, int, Callable[[], None]]:
    """Serve the picker and gRPC health on host:port; returns (server, bound port, stop the
    readiness updates). Health: "" is liveness (always SERVING while the process answers),
    the ext_proc service's name is readiness (SERVING while some worker is routable)."""
    server = grpc.aio.server()
    p.services.add_ExternalProcessorServicer_to_server(EndpointPicker(picker), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    task = asyncio.get_running_loop().create_task(_readiness(picker, checks, ready_every))
    return server, bound, task.cancel


async def _readiness(picker: Picker, checks: Any, every: float) -> None:
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    while True:
        await checks.set(SERVICE, serving if picker.ready() else not_serving)
        await asyncio.sleep(every)
