"""The routes that work with the engine without generating text: vLLM's /tokenize and
/detokenize, SGLang's /abort_request, and the admin routes that change the scheduler's
settings while it runs (SGLang's /set_internal_state, and /update_scheduler_settings)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from starlette.requests import Request

from radixserve.engine.tokenizer_manager import RequestError
from radixserve.server.control_bodies import (
    AbortRequest,
    DetokenizeRequest,
    InternalState,
    SchedulerSettings,
    TokenizeRequest,
)
from radixserve.server.errors import ApiError
from radixserve.server.openapi_bodies import openapi_body
from radixserve.server.routes import chat_input
from radixserve.server.state import ServerState, read_json


def control_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    limit = state.config.max_payload_size
    user = [Depends(state.authorize)]

    @router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest), dependencies=user)
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request, TokenizeRequest, limit)
        state.check_model(body.model)
        ids = _tokenize(state, body)
        strs = _token_strs(state.tm.tokenizer, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.tm.context_length, "tokens": ids,
                "token_strs": strs}  # fmt: skip

    @router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest), dependencies=user)
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request, DetokenizeRequest, limit)
        state.check_model(body.model)
        vocab = state.tm.tokenizer.vocab_size
        if body.tokens and max(body.tokens) >= vocab:
            raise ApiError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        # special tokens stay: the text tokenizes back to the same ids
        return {"prompt": state.tm.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @router.post("/abort_request", openapi_extra=openapi_body(AbortRequest))
    async def abort_request(request: Request) -> dict[str, Any]:
        try:  # the API key, or the admin key (which alone may abort every request)
            state.authorize(request)
        except ApiError:
            state.authorize_admin(request)
        body = await read_json(request, AbortRequest, limit)
        if not body.abort_all and not body.rid:
            raise ApiError(400, "give the rid of the request to abort, or abort_all", param="rid")
        if body.abort_all:  # ends every client's requests: an admin action
            state.authorize_admin(request)
        aborted = await state.tm.abort(None if body.abort_all else body.rid)
        return {"success": True, "aborted": aborted}

    return router


def admin_routes(state: ServerState) -> APIRouter:
    """Guarded by --admin-api-key when the server has one (else by --api-key)."""
    router = APIRouter(dependencies=[Depends(state.authorize_admin)])
    limit = state.config.max_payload_size

    @router.get("/debug/check_integrity")
    async def check_integrity() -> dict[str, Any]:
        """The scheduler recounts its KV accounting; where every slot is (free, evictable,
        held) and, on a prefill or decode engine, the rooms it keeps."""
        return await state.tm.control("check_integrity", timeout=10.0)

    @router.post("/update_scheduler_settings", openapi_extra=openapi_body(SchedulerSettings))
    async def update_scheduler_settings(request: Request) -> dict[str, Any]:
        body = await read_json(request, SchedulerSettings, limit)
        return {"updated": True, "scheduler": await _update(state, body.changes())}

    @router.post("/set_internal_state", openapi_extra=openapi_body(InternalState))
    async def set_internal_state(request: Request) -> dict[str, Any]:
        body = await read_json(request, InternalState, limit)
        return {"updated": True, "scheduler": await _update(state, body.server_args.changes())}

    return router


async def _update(state: ServerState, changes: dict[str, Any]) -> dict[str, Any]:
    """Apply ``changes`` in the scheduler process, between two of its steps."""
    if not changes:
        raise ApiError(400, "name at least one setting to change", param="schedule_policy")
    try:
        out = await state.tm.control("update_scheduler_settings", 5.0, changes)
    except (RequestError, asyncio.TimeoutError) as e:
        raise ApiError(503, f"the engine did not answer: {e!r}", "engine_unavailable") from e
    if "error" in out:
        raise ApiError(400, out["error"], param=next(iter(changes)))
    state.note_settings(out["scheduler"])
    return out["scheduler"]


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's own string (a Hugging Face tokenizer's pieces, "Ġthe"), else its text."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "id_to_token"):
        return [inner.id_to_token(i) for i in ids]
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    tm = state.tm
    inp = chat_input(state, body) if body.messages is not None else None
    try:
        if inp is None:
            return tm.tokenizer.encode(body.prompt or "", body.add_special_tokens is not False)
        return tm.tokenizer.encode(tm.render_chat(inp), body.add_special_tokens is True)
    except RequestError as e:
        raise ApiError.from_engine(e, "messages") from e
    except Exception as e:  # a model without a chat template, a template that refuses
        raise ApiError(400, f"cannot tokenize: {e}", param="messages") from e
