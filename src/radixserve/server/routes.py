"""The generation endpoints: OpenAI's /v1/completions and /v1/chat/completions and SGLang's
/generate, each answered whole or streamed as server-sent events ending in ``data: [DONE]``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request

from radixserve.engine.messages import TextOut
from radixserve.engine.tokenizer_manager import (
    SERVER_RID_PREFIX,
    GenerateInput,
    RequestError,
    prompt_inputs,
)
from radixserve.sched.request import SamplingParams
from radixserve.server.chat_io import (
    chat_output,
    check_tools,
    forced_grammar,
    keeps_special_tokens,
    render_inputs,
)
from radixserve.server.chat_output import ChatDeltas, ChatOutput
from radixserve.server.control_bodies import TokenizeRequest
from radixserve.server.errors import ApiError
from radixserve.server.logprobs import generate_meta
from radixserve.server.openapi_bodies import openapi_body
from radixserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    GenerateSampling,
    bootstraps,
    scheduling_fields,
)
from radixserve.server.responses import DONE, Choice, Head, JSONBody, generate_body, sse
from radixserve.server.state import ServerState, read_json
from radixserve.server.streams import Generation, unless_disconnected

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
Render = Callable[[Choice, TextOut], Iterable[bytes]]
# the OpenAI routes' names for SamplingParams fields whose names differ (in error messages)
OPENAI_NAMES = {"min_new_tokens": "min_tokens", "grammar": "response_format",
                "return_logprob": "logprobs", "no_stop_trim": "include_stop_str_in_output"}  # fmt: skip
OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate


def inference_routes(state: ServerState) -> APIRouter:
    router = APIRouter(dependencies=[Depends(state.authorize)])
    limit = state.config.max_payload_size

    @router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        start = time.perf_counter()
        body = await read_json(request, CompletionRequest, limit)
        return await _openai(request, state, body, _completion_inputs(body), start)

    @router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        start = time.perf_counter()
        body = await read_json(request, ChatCompletionRequest, limit)
        return await _openai(request, state, body, [chat_input(state, body)], start)

    @router.post("/generate", openapi_extra=openapi_body(GenerateRequest))
    async def generate(request: Request) -> Response:
        start = time.perf_counter()
        body = await read_json(request, GenerateRequest, limit)
        return await _generate(request, state, body, start)

    return router


# -- OpenAI ----------------------------------------------------------------------------------
def _completion_inputs(body: CompletionRequest) -> list[GenerateInput]:
    return _prompts(body.prompt, "prompt")[0]


def _prompts(value: Any, param: str) -> tuple[list[GenerateInput], bool]:
    try:
        return prompt_inputs(value)
    except ValueError as e:
        raise ApiError(400, str(e), param=param) from None


def chat_input(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> GenerateInput:
    """A chat's messages, tools and template variables as the engine renders them."""
    messages = [chat_message(m, i) for i, m in enumerate(body.messages or [])]
    messages, extra = render_inputs(messages, body, state.tm.tokenizer.chat_template,
                                    state.tool_parser)  # fmt: skip
    return GenerateInput(messages=messages, add_generation_prompt=body.add_generation_prompt,
                         continue_final_message=body.continue_final_message,
                         template_vars=extra)  # fmt: skip


def chat_message(m: ChatMessage, i: int) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        if any(p.type != "text" for p in content):
            raise ApiError(400, "only text content parts are supported", "unsupported_content",
                           f"messages.{i}.content")  # fmt: skip
        content = "\n".join(p.text or "" for p in content)  # as vLLM joins text parts
    out: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    out |= _reasoning(m, i)
    return out | {"name": m.name} if m.name else out


def _reasoning(m: ChatMessage, i: int) -> dict[str, str]:
    """An assistant message's past reasoning, under either name (as this server answers both,
    a client may send a message back as it got it); on another role it is refused."""
    given = {k: v for k in ("reasoning_content", "reasoning") if (v := getattr(m, k)) is not None}
    if not given:
        return {}
    name = next(iter(given))
    if m.role != "assistant":
        raise ApiError(400, f"{name} belongs on an assistant message", param=f"messages.{i}.{name}")
    if len(set(given.values())) > 1:
        raise ApiError(400, "reasoning_content and reasoning differ: send one",
                       param=f"messages.{i}.reasoning")  # fmt: skip
    return {"reasoning_content": given[name]}


async def _openai(
    request: Request, state: ServerState, body: CompletionRequest | ChatCompletionRequest,
    prompts: list[GenerateInput], start: float,
) -> Response:  # fmt: skip
    state.check_model(body.model)
    state.check_priority(body.priority)
    state.check_batch(len(prompts) * body.n)
    chat = isinstance(body, ChatCompletionRequest)
    asked = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
    limit_param = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
    params = ("messages" if chat else "prompt", limit_param)
    default = None if chat else OPENAI_DEFAULT_MAX_TOKENS
    sampling = body.sampling(asked)
    output = _chat_sampling(state, body, sampling) if chat else None
    prepared = [state.prepare(p, sampling, default, params, OPENAI_NAMES) for p in prompts]
    fields = scheduling_fields(body)
    inputs = [dataclasses.replace(p, **fields, sampling=_nth_seed(p.sampling, i))
              for p in prepared for i in range(body.n)]  # fmt: skip
    inputs = state.with_bootstrap(inputs, bootstraps(body, len(inputs)))
    asked_lp = prepared[0].sampling.return_logprob if prepared else False
    head = (Head.new(chat, state.model_name, state.token_text, state.visible_text) if asked_lp
            else Head.new(chat, state.model_name))  # fmt: skip
    head = dataclasses.replace(head, output=output)
    gen = state.start(inputs, start)
    if not chat and body.echo:
        _echo(state, gen, [p for p in prompts for _ in range(body.n)], inputs)
    if body.stream:
        return await stream_response(request, gen, _openai_events(gen, head, body))
    return JSONBody(head.body(await _collect(request, gen), body.n))


def _chat_sampling(
    state: ServerState, body: ChatCompletionRequest, sampling: dict[str, Any]
) -> ChatOutput:
    """The parsers a chat's choices are read with; the sampling they need set in ``sampling``:
    a forced call's grammar, and special tokens kept where a format opens its calls with one."""
    sampling["grammar"] = _chat_grammar(state, body, sampling["grammar"])
    output = chat_output(state.tool_parser, state.config.reasoning_parser, body)
    if keeps_special_tokens(output, body):
        sampling["skip_special_tokens"] = False
    return output


def _chat_grammar(
    state: ServerState, body: ChatCompletionRequest, asked: tuple[str, str] | None
) -> tuple[str, str] | None:
    """The grammar of a forced tool call, or the one the request asked for (not both)."""
    check_tools(body, state.tool_parser)
    forced = forced_grammar(body, state.tool_parser)
    if forced is not None and asked is not None:
        raise ApiError(400, "a forced tool call cannot have response_format, json_schema or "
                       "regex too", param="tool_choice")  # fmt: skip
    return forced or asked


def _nth_seed(sampling: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i`` of ``n`` draws with ``seed + i`` (vLLM's rule), so that the n samples of a
    seeded request differ from each other and each can be reproduced alone."""
    if i == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + i)


def _echo(
    state: ServerState, gen: Generation, asked: list[GenerateInput], sent: list[GenerateInput]
) -> None:
    """Completions with ``echo``: each choice's text starts with its prompt."""
    for c, a, inp in zip(gen.choices, asked, sent, strict=True):
        c.prompt_ids = list(inp.input_ids or [])
        c.echo = a.text if a.text is not None else state.tm.tokenizer.decode(c.prompt_ids)


def _openai_events(
    gen: Generation, head: Head, body: CompletionRequest | ChatCompletionRequest
) -> AsyncIterator[bytes]:
    usage = body.include_usage
    render = _chat_render(head, usage) if head.chat else _text_render(head, usage)
    opening = [_chat_opening(head, len(gen.choices), usage)] if head.chat else []

    def closing() -> list[bytes]:
        return [sse(head.usage_chunk(gen.choices, body.n))] if usage else []

    return _events(gen, render, opening, closing)


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    # OpenAI sends "usage": null on every chunk but the last one when usage is asked for
    return chunk | {"usage": None} if include_usage else chunk


def _text_render(head: Head, include_usage: bool) -> Render:
    def render(c: Choice, out: TextOut) -> Iterable[bytes]:
        first = len(c.parts) == 1  # the echoed prompt goes out with the first delta
        text = c.echo + out.text if first else out.text
        lps = head.logprobs(c, out.logprobs or [], out.token_ids, first, c.text_offset)
        if lps and lps["tokens"]:  # where the next chunk's first token starts
            c.text_offset = lps["text_offset"][-1] + len(head.visible(out.token_ids[-1]))
        if text or out.finished or (lps and lps["tokens"]):  # a token whose text waits
            chunk = head.chunk(c.index, text, c.finish_reason, lps)
            yield sse(_with_usage(chunk, include_usage))

    return render


def _chat_render(head: Head, include_usage: bool) -> Render:
    streams: dict[int, ChatDeltas] = {}

    def render(c: Choice, out: TextOut) -> Iterable[bytes]:
        deltas = streams.setdefault(c.index, (head.output or ChatOutput()).stream())
        lps = head.logprobs(c, out.logprobs or [], out.token_ids, False)
        found = deltas.feed(out.text) if out.text else []
        finish = c.finish_reason
        if out.finished:
            more, finish = deltas.finish(finish)
            found += more
        for i, delta in enumerate(found or ([{}] if lps else [])):
            chunk = head.chunk(c.index, delta, None, lps if i == 0 else None)
            yield sse(_with_usage(chunk, include_usage))
        if out.finished:
            yield sse(_with_usage(head.chunk(c.index, {}, finish), include_usage))

    return render


def _chat_opening(head: Head, n: int, include_usage: bool) -> bytes:
    """The first chunk of every chat choice names the role, as OpenAI's do."""
    delta = {"role": "assistant", "content": ""}
    return b"".join(sse(_with_usage(head.chunk(i, delta, None), include_usage)) for i in range(n))


# -- SGLang ----------------------------------------------------------------------------------
async def _generate(
    request: Request, state: ServerState, body: GenerateRequest, start: float
) -> Response:
    prompts, batch, param = _generate_prompts(body)
    state.check_batch(len(prompts))  # before tokenizing any of them
    state.check_priority(body.priority)
    samplings = _samplings(body.sampling_params, len(prompts))
    rids = _rids(body.rid, len(prompts), batch)
    params = (param, "sampling_params.max_new_tokens")
    n = len(prompts)
    asked = [s.sampling(s.max_new_tokens) | body.logprob_args(i, n)
             for i, s in enumerate(samplings)]  # fmt: skip
    inputs = [
        state.prepare(p, a, SGLANG_DEFAULT_MAX_NEW_TOKENS, params) for p, a in zip(prompts, asked)
    ]
    fields = scheduling_fields(body)
    inputs = [dataclasses.replace(p, **fields, rid=r) for p, r in zip(inputs, rids)]
    inputs = state.with_bootstrap(inputs, bootstraps(body, len(inputs)))
    gen = state.start(inputs, start)
    text = state.token_text if body.return_text_in_logprobs else None
    for c, inp in zip(gen.choices, inputs):
        # a decode engine computed no prompt: its input logprobs are the prefill engine's,
        # which a PD router puts in front of these (SGLang's merge), so it adds none
        asked = inp.sampling.return_logprob and state.tm.pd_mode != "decode"
        c.prompt_ids = list(inp.input_ids or []) if asked else []

    def result(c: Choice) -> dict[str, Any]:
        out = generate_body(c, batch)
        out["meta_info"] |= generate_meta(c, inputs[c.index].sampling, text)
        return out

    if body.stream:

        def render(c: Choice, _: TextOut) -> list[bytes]:
            return [sse(result(c))]

        return await stream_response(request, gen, _events(gen, render, [], list))
    choices = await _collect(request, gen)
    return JSONBody([result(c) for c in choices] if batch else result(choices[0]))


def _generate_prompts(body: GenerateRequest) -> tuple[list[GenerateInput], bool, str]:
    """The prompts, whether they came as a batch, and the field they came in."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", param="text")
    param = "text" if body.text is not None else "input_ids"
    inputs, batch = _prompts(getattr(body, param), param)
    return inputs, batch, param


def _samplings(
    given: GenerateSampling | list[GenerateSampling] | None, count: int
) -> list[GenerateSampling]:
    if not isinstance(given, list):
        return [given or GenerateSampling()] * count
    if len(given) != count:
        raise ApiError(400, f"sampling_params has {len(given)} entries for {count} prompts",
                       param="sampling_params")  # fmt: skip
    return given


def _rids(given: str | list[str] | None, count: int, batch: bool) -> list[str | None]:
    """SGLang's rid: one per prompt (a list for a batch); never in the server's own form."""
    rids = given if isinstance(given, list) else [given] * count
    if given is not None and (isinstance(given, list) != batch or len(rids) != count):
        raise ApiError(400, "rid must be one string for one prompt, or a list of one per "
                       "prompt for a batch", param="rid")  # fmt: skip
    if any(r is not None and r.startswith(SERVER_RID_PREFIX) for r in rids):
        raise ApiError(400, f"a rid may not start with {SERVER_RID_PREFIX!r}: the server's own "
                       "request ids do", param="rid")  # fmt: skip
    if given is not None and len(set(rids)) != count:
        raise ApiError(400, "the rids of a batch must differ", param="rid")
    return rids


# -- shared ----------------------------------------------------------------------------------
async def _collect(request: Request, gen: Generation) -> list[Choice]:
    try:
        return await unless_disconnected(request, gen.collect())
    finally:
        gen.close()


async def _events(
    gen: Generation, render: Render, opening: list[bytes], closing: Callable[[], list[bytes]]
) -> AsyncIterator[bytes]:
    """SSE events; nothing is yielded before the first output, so that an error the engine
    reports before any token (a prompt it refuses, a dead engine) still gets its HTTP status."""
    outputs = gen.outputs()
    choice, out = await anext(outputs)
    for event in opening:
        yield event
    for event in render(choice, out):
        yield event
    try:
        async for choice, out in outputs:
            for event in render(choice, out):
                yield event
    except RequestError as e:  # too late for a status code: the error is the last event
        yield sse(ApiError.from_engine(e).body())
    else:
        for event in closing():
            yield event
    yield DONE


async def stream_response(
    request: Request, gen: Generation, events: AsyncIterator[bytes]
) -> Response:
    """An SSE response that starts once the first event is ready (an error before it is a
    plain error response); the generation is aborted when the client goes away."""
    try:
        first = await unless_disconnected(request, anext(events))
    except BaseException:
        gen.close()
        raise
    return StreamingResponse(_chain(first, events, gen), media_type="text/event-stream",
                             headers=SSE_HEADERS)  # fmt: skip


async def _chain(
    first: bytes, events: AsyncIterator[bytes], gen: Generation
) -> AsyncIterator[bytes]:
    try:
        yield first
        async for event in events:
            if event:  # an empty chunk would be a no-op write
                yield event
    finally:
        gen.close()  # a client that went away cancels the stream here: abort what still runs
