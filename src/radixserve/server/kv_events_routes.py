"""``GET /kv_events/snapshot``: every KV-cache block the engine has announced, with the ``seq``
of the last event batch it reflects (format: engine/kv_events.py), for indexers that join late."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from radixserve.engine.tokenizer_manager import RequestError
from radixserve.server.errors import ApiError
from radixserve.server.responses import JSONBody
from radixserve.server.state import ServerState

SNAPSHOT_TIMEOUT_S = 30.0  # taken between two scheduler steps; a long prefill delays it


def kv_events_routes(state: ServerState) -> APIRouter:
    router = APIRouter(dependencies=[Depends(state.authorize)])

    @router.get("/kv_events/snapshot")
    async def snapshot() -> JSONBody:
        if state.engine.info.get("kv_events") is None:
            raise ApiError(404, "KV events are off; start the server with --kv-events-config",
                           "kv_events_disabled")  # fmt: skip
        try:
            snap = await state.tm.control("kv_events_snapshot", timeout=SNAPSHOT_TIMEOUT_S)
        except (RequestError, asyncio.TimeoutError) as e:
            raise ApiError(503, f"the engine did not answer: {e!r}", "engine_unavailable") from e
        return JSONBody(snap)

    return router
