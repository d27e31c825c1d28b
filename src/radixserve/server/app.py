"""The HTTP face of one engine: ``create_app`` builds the FastAPI app with the generation routes
(routes.py) and the health, info, cache and metrics endpoints defined here."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response

from radixserve import __version__
from radixserve.engine.launch import EngineProcesses
from radixserve.engine.tokenizer_manager import GenerateInput, RequestError
from radixserve.sched.request import SamplingParams
from radixserve.server.anthropic import anthropic_routes
from radixserve.server.anthropic_protocol import BODIES as ANTHROPIC_BODIES
from radixserve.server.config import ServerConfig
from radixserve.server.control import admin_routes, control_routes
from radixserve.server.docs import RequestIdMiddleware, add_docs
from radixserve.server.errors import ApiError, install_handlers
from radixserve.server.kv_events_routes import kv_events_routes
from radixserve.server.metrics import CONTENT_TYPE, stats_dict
from radixserve.server.openapi_bodies import add_body_schemas
from radixserve.server.responses import JSONBody
from radixserve.server.routes import inference_routes
from radixserve.server.state import ServerState
from radixserve.server.tracing import TraceMiddleware
from radixserve.tracing import open_tracer

STATS_TIMEOUT_S = 5.0  # a scrape should not hang on a scheduler stuck in a long step
RATIOS = ("kv_load_to_prefill_ratio", "kv_store_load_to_prefill_ratio")  # engine/load_meter.py


def create_app(config: ServerConfig, engine: EngineProcesses) -> FastAPI:
    """The app for a launched engine; its lifespan starts and stops the tokenizer manager."""
    state = ServerState.create(config, engine)
    tracer = open_tracer(engine.config.trace, "radixserve-engine")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.tm.start()
        try:
            yield
        finally:
            await state.tm.close()
            if tracer is not None:
                tracer.close()

    app = FastAPI(
        title="radixserve",
        version=__version__,
        lifespan=lifespan,
        default_response_class=JSONBody,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )  # fmt: skip  (docs.py serves them behind --api-key)
    app.state.server = state
    install_handlers(app)
    add_docs(app, state)
    if tracer is not None:  # inside RequestIdMiddleware: the span names the request id
        app.add_middleware(TraceMiddleware, tracer=tracer)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(inference_routes(state))
    app.include_router(anthropic_routes(state))
    app.include_router(control_routes(state))
    app.include_router(admin_routes(state))
    app.include_router(_open_routes(state))
    app.include_router(_admin_routes(state))
    app.include_router(kv_events_routes(state))
    _use_body_schemas(app)
    return app


def _use_body_schemas(app: FastAPI) -> None:
    # the generation routes read their bodies themselves (size limit, strict JSON), so their
    # schemas are added to the document by hand
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = add_body_schemas(doc, ANTHROPIC_BODIES)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _stats(state: ServerState) -> dict[str, Any] | None:
    """The scheduler's counters, or None if the engine cannot answer."""
    if state.dead():
        return None
    try:
        stats = stats_dict(await state.tm.control("stats", timeout=STATS_TIMEOUT_S))
        if state.engine.info.get("kv_events") is not None:  # the publisher's counters
            stats |= await state.tm.control("kv_events_stats", timeout=STATS_TIMEOUT_S)
        return stats
    except (RequestError, asyncio.TimeoutError):
        return None


def _ratios(info: dict[str, Any], stats: dict[str, Any] | None) -> dict[str, Any]:
    """The load-to-prefill ratios as the engine reports them now (its start-up values while
    it cannot answer)."""
    return {k: (stats or info).get(k) for k in RATIOS}


async def _scheduler(state: ServerState) -> dict[str, Any]:
    """The scheduler's live settings (changed at run time or not); the launch settings if the
    engine cannot answer."""
    if state.dead() is None:
        try:
            return await state.tm.control("scheduler_config", timeout=STATS_TIMEOUT_S)
        except (RequestError, asyncio.TimeoutError):
            pass
    return dataclasses.asdict(state.engine.config.sched)


def _open_routes(state: ServerState) -> APIRouter:
    """Probes and metrics: no API key, so that orchestrators and scrapers need none."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        dead = state.dead()
        if dead:
            raise ApiError(503, f"the engine is down: {dead}", "engine_unavailable")
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy only if a one-token generation completes in time."""
        probe = GenerateInput(text="ping", sampling=SamplingParams(max_new_tokens=1, temperature=0))
        try:
            await asyncio.wait_for(_drain(state, probe), state.config.health_generate_timeout_secs)
        except (RequestError, asyncio.TimeoutError) as e:
            raise ApiError(503, f"the engine cannot generate: {e!r}", "engine_unavailable") from e
        return Response(status_code=200)

    @router.get("/get_loads")
    async def loads() -> dict[str, Any]:
        """What a router balances on: requests running and waiting, prefill tokens left, and
        what loading a token from the host tier / the store costs against prefilling it."""
        stats = await _stats(state)
        if stats is None:
            raise ApiError(503, "the engine did not answer", "engine_unavailable")
        keys = ("num_running", "num_waiting", "waiting_prefill_tokens", "kv_usage", *RATIOS)
        return {k: stats.get(k) for k in keys}

    @router.get("/metrics")
    async def metrics() -> Response:
        state.metrics.set_engine(await _stats(state))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return router


async def _drain(state: ServerState, inp: GenerateInput) -> None:
    async for _ in state.tm.generate(inp):
        pass


def _admin_routes(state: ServerState) -> APIRouter:
    router = APIRouter(dependencies=[Depends(state.authorize)])

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": int(state.started),
                "owned_by": "radixserve", "root": _model_path(state),
                "max_model_len": state.tm.context_length}  # fmt: skip
        return {"object": "list", "data": [card]}

    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        info = state.engine.info
        return {"model_path": _model_path(state), "tokenizer_path": _model_path(state),
                "served_model_name": state.model_name, "is_generation": True,
                "context_length": state.tm.context_length,
                "vocab_size": info.get("vocab_size"),
                "max_total_tokens": info.get("max_total_tokens"),
                # what a kv_aware router needs to tokenize exactly as this server does,
                # chats with tools included (the format of its default tools prompt)
                "tokenizer_fingerprint": state.engine.tokenizer.fingerprint(),
                "tool_call_parser": state.tool_parser}  # fmt: skip

    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        ec, stats = state.engine.config, await _stats(state)
        return {
            "version": __version__, "served_model_name": state.model_name,
            "uptime_s": round(time.time() - state.started, 3),
            "server": state.config.public(), "model": dataclasses.asdict(ec.model),
            "cache": dataclasses.asdict(ec.cache), "scheduler": await _scheduler(state),
            "engine": state.engine.info, "engine_alive": state.dead() is None,
            "kv_events": state.engine.info.get("kv_events"),
            "kv_store": state.engine.info.get("kv_store"),
            **_ratios(state.engine.info, stats),
            "stats": stats,
        }  # fmt: skip

    @router.get("/server_info")
    async def sglang_server_info() -> dict[str, Any]:
        """SGLang's flat shape (its server arguments at the top level), under its current
        name: what SGLang's routers read a worker's model and role from."""
        return await _sglang_server_info(state)

    @router.get("/model_info")
    async def sglang_model_info() -> dict[str, Any]:
        return await model_info()

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONBody:
        try:
            flushed = await state.tm.control("flush_cache", timeout=STATS_TIMEOUT_S)
        except asyncio.TimeoutError as e:
            raise ApiError(503, "the engine did not answer", "engine_unavailable") from e
        if not flushed:
            raise ApiError(409, "requests are running or waiting; the prefix cache can only be "
                           "flushed while the engine is idle", "engine_busy")  # fmt: skip
        return JSONBody({"success": True, "message": "Cache flushed."})

    return router


async def _sglang_server_info(state: ServerState) -> dict[str, Any]:
    ec, info = state.engine.config, state.engine.info
    sched = await _scheduler(state)
    keys = ("schedule_policy", "max_prefill_tokens", "chunked_prefill_size", "max_running_requests")
    disagg = dataclasses.asdict(ec.disagg)
    return {"version": __version__, "model_path": _model_path(state),
            "tokenizer_path": _model_path(state), "served_model_name": state.model_name,
            "context_length": state.tm.context_length, "page_size": ec.cache.page_size,
            "max_total_tokens": info.get("max_total_tokens"), "tp_size": 1, "dp_size": 1,
            **{k: sched.get(k) for k in keys},
            **{k: v for k, v in disagg.items() if k.startswith("disaggregation_")}}  # fmt: skip


def _model_path(state: ServerState) -> str:
    ec = state.engine.config
    if ec.sim is not None:
        return f"sim:{ec.sim}"
    return ec.model.model or "built-in:SmolLM2-135M"
