"""Anthropic's Messages API: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens``. A request is translated into the chat request the OpenAI
route serves and runs through the same template, tool parsers, forced-call grammars and engine;
its answer and its errors go back in Anthropic's shapes."""

from __future__ import annotations

import dataclasses
import hmac
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.requests import Request

from radixserve.engine.tokenizer_manager import RequestError
from radixserve.server.anthropic_events import MessageEvents, sse_event
from radixserve.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    content_blocks,
    error_body,
    message_id,
    stop_reason,
    usage,
)
from radixserve.server.chat_io import (
    chat_output,
    check_tools,
    forced_grammar,
    keeps_special_tokens,
)
from radixserve.server.chat_output import ChatOutput
from radixserve.server.errors import ApiError
from radixserve.server.openapi_bodies import openapi_body
from radixserve.server.protocol import ChatCompletionRequest, bootstraps, scheduling_fields
from radixserve.server.responses import Choice, JSONBody
from radixserve.server.routes import chat_input, stream_response
from radixserve.server.state import ServerState, read_json
from radixserve.server.streams import Generation, unless_disconnected


def anthropic_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    limit = state.config.max_payload_size

    @router.post("/v1/messages", openapi_extra=openapi_body(MessagesRequest))
    async def messages(request: Request) -> Response:
        start = time.perf_counter()
        try:
            _authorize(state, request)
            body = await read_json(request, MessagesRequest, limit)
            return await _messages(request, state, body, start)
        except (ApiError, ValidationError, RequestError) as e:
            return _error(e)

    @router.post("/v1/messages/count_tokens", openapi_extra=openapi_body(CountTokensRequest))
    async def count_tokens(request: Request) -> Response:
        try:
            _authorize(state, request)
            body = await read_json(request, CountTokensRequest, limit)
            state.check_model(body.model)
            chat = _chat(state, body)
            check_tools(chat, state.tool_parser)
            return JSONBody({"input_tokens": len(_tokenize(state, chat))})
        except (ApiError, ValidationError, RequestError) as e:
            return _error(e)

    return router


def _authorize(state: ServerState, request: Request) -> None:
    """Anthropic's clients send the key as ``x-api-key``; OpenAI's bearer form works too."""
    key = state.config.api_key
    if key is None:
        return
    given = request.headers.get("x-api-key")
    if given is not None and hmac.compare_digest(given.encode(), key.encode()):
        return
    state.authorize(request)  # raises 401 unless the bearer key is right


def _error(e: ApiError | ValidationError | RequestError) -> JSONBody:
    if isinstance(e, ValidationError):
        e = ApiError.from_validation(e)
    elif isinstance(e, RequestError):
        e = ApiError.from_engine(e)
    return JSONBody(error_body(e), status_code=e.status)


def _chat(state: ServerState, body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    chat = chat_request(body)
    if body.thinking is not None:  # {"type": "disabled"}, the one value the body admits
        chat |= _thinking_off(state)
    return ChatCompletionRequest.model_validate(chat)


def _thinking_off(state: ServerState) -> dict[str, Any]:
    """``thinking: {"type": "disabled"}`` honoured through the template's enable_thinking
    switch where it has one. Without the switch, a server that splits reasoning off
    (--reasoning-parser) cannot turn it off: refused, naming the field; one that does not has
    no reasoning to turn off."""
    template = getattr(state.tm.tokenizer, "chat_template", None) or ""
    if re.search(r"\benable_thinking\b", template):
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if state.config.reasoning_parser:
        raise ApiError(400, "this model's chat template has no enable_thinking switch: its "
                       "reasoning cannot be disabled", param="thinking")  # fmt: skip
    return {}


def _tokenize(state: ServerState, chat: ChatCompletionRequest) -> list[int]:
    try:
        return list(state.tm.tokenize(chat_input(state, chat)))
    except RequestError as e:
        raise ApiError.from_engine(e, "messages") from e
    except ApiError:
        raise
    except Exception as e:  # a chat template that refuses the conversation
        raise ApiError(400, f"cannot tokenize the prompt: {e}", param="messages") from e


async def _messages(
    request: Request, state: ServerState, body: MessagesRequest, start: float
) -> Response:
    state.check_model(body.model)
    chat = _chat(state, body)
    check_tools(chat, state.tool_parser)
    output = chat_output(state.tool_parser, state.config.reasoning_parser, chat)
    sampling = chat.sampling(body.max_tokens)
    sampling["grammar"] = _grammar(state, chat, sampling["grammar"])
    # formats that open their calls with a special token ([TOOL_CALLS]) need it in the text
    sampling["skip_special_tokens"] = not keeps_special_tokens(output, chat)
    inp = state.prepare(chat_input(state, chat), sampling, None, ("messages", "max_tokens"))
    inp = dataclasses.replace(inp, **scheduling_fields(chat))
    (inp,) = state.with_bootstrap([inp], bootstraps(body, 1))
    head = {"id": message_id(), "type": "message", "role": "assistant", "model": state.model_name}
    gen = state.start([inp], start)
    if body.stream:
        return await stream_response(request, gen, _events(gen, head, output, body))
    try:
        (c,) = await unless_disconnected(request, gen.collect())
    finally:
        gen.close()
    return JSONBody(_message(head, output, c, body))


def _grammar(
    state: ServerState, chat: ChatCompletionRequest, asked: tuple[str, str] | None
) -> tuple[str, str] | None:
    """A forced tool call's grammar, or output_config.format's (not both)."""
    forced = forced_grammar(chat, state.tool_parser)
    if forced is not None and asked is not None:
        raise ApiError(400, "a forced tool call (tool_choice any or tool) cannot have "
                       "output_config.format too", param="output_config.format")  # fmt: skip
    return forced or asked


def _message(
    head: dict[str, Any], output: ChatOutput, c: Choice, body: MessagesRequest
) -> dict[str, Any]:
    message, finish = output.message(c.text, c.finish_reason)
    reason, seq = stop_reason(finish, c.last.matched_stop if c.last else None, body.stop_sequences)
    return head | {"content": content_blocks(message), "stop_reason": reason,
                   "stop_sequence": seq, "usage": _usage(c)}  # fmt: skip


def _usage(c: Choice) -> dict[str, Any]:
    return usage(c.count("prompt_tokens"), c.count("cached_tokens"), c.count("completion_tokens"))


async def _events(
    gen: Generation, head: dict[str, Any], output: ChatOutput, body: MessagesRequest
) -> AsyncIterator[bytes]:
    """The message's events; nothing before the engine's first output, so that an error before
    any token (a prompt it refuses) still gets its HTTP status."""
    outputs = gen.outputs()
    c, out = await anext(outputs)
    seq, deltas = MessageEvents(), output.stream()
    yield _sse(MessageEvents.start(head, _usage(c) | {"output_tokens": 0}))
    try:
        while True:
            found = deltas.feed(out.text) if out.text else []
            if out.finished:
                more, finish = deltas.finish(c.finish_reason)
                reason, stop = stop_reason(finish, out.matched_stop, body.stop_sequences)
                yield _sse(
                    seq.feed(found + more) + seq.finish(reason, stop, _usage(c)["output_tokens"])
                )
                return
            yield _sse(seq.feed(found))
            c, out = await anext(outputs)
    except RequestError as e:  # too late for a status code: the error is the last event
        yield sse_event("error", error_body(ApiError.from_engine(e)))


def _sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(sse_event(name, data) for name, data in events)
