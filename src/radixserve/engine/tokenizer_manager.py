"""The API process's side of the engine: tokenize, send to the scheduler process, and hand each
request's text deltas back to its caller as they arrive; abort on cancel; fail fast if a child
process dies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import uuid
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixserve.cache.tokens import token_array
from radixserve.engine.messages import (
    AbortReq,
    ControlOut,
    ControlReq,
    ErrorOut,
    GenerateReq,
    TextBatch,
    TextOut,
)
from radixserve.engine.pd_bootstrap import RouteCache
from radixserve.sched.request import SamplingParams

# The engine's own request ids start with this; a client's rid may not, so that no client can
# take (or abort) an id the server hands another client's request.
SERVER_RID_PREFIX = "rs-"
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""Appended to a continued last message to find where its content ends once rendered (the
marker transformers uses, so the text is the one vLLM renders)."""
TRACEPARENT: ContextVar[str | None] = ContextVar("radixserve_traceparent", default=None)
"""--enable-trace: the traceparent of the HTTP request being served (set by the server around
each request), sent with its GenerateReqs so that the scheduler's spans join its trace."""


class RequestError(Exception):
    """A request the engine refused or could not finish; ``code`` is the HTTP status."""

    def __init__(
        self, message: str, code: int = 400, err_type: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.message, self.code, self.err_type = message, code, err_type
        self.param = param


class EngineDeadError(RequestError):
    def __init__(self, message: str) -> None:
        super().__init__(message, 503, "engine_unavailable")


@dataclass(slots=True)
class GenerateInput:
    """What a caller asks for: a prompt as text, token ids or chat messages."""

    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    priority: int = 0
    routing_key: str | None = None
    namespace: str | None = None
    # chat only (vLLM's semantics): open the assistant's turn, or continue the last message
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # max_new_tokens 0: prefill (and cache) the prompt only; no text comes back
    prefill_only: bool = False
    # chat only: the template's variables besides the messages (tools, chat_template_kwargs)
    template_vars: dict[str, Any] = field(default_factory=dict)
    # prefill/decode disaggregation (SGLang's fields): bootstrap (host, port, room)
    bootstrap: tuple[str, int, int] | None = None


def prompt_inputs(prompt: Any) -> tuple[list[GenerateInput], bool]:
    """One prompt or a batch of them, as text or token ids: the inputs, and whether it was a
    batch. ValueError when there is no prompt at all."""
    if isinstance(prompt, str):
        return [GenerateInput(text=prompt)], False
    if not prompt:
        raise ValueError("the prompt is empty")
    if isinstance(prompt[0], int):
        return [GenerateInput(input_ids=list(prompt))], False
    return [
        GenerateInput(text=p) if isinstance(p, str) else GenerateInput(input_ids=list(p))
        for p in prompt
    ], True


@dataclass(slots=True)
class _Pending:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last: TextOut | None = None  # what the caller saw last; an abort repeats its counts
    aborted: bool = False


class TokenizerManager:
    """Runs in the caller's event loop; one instance per engine."""

    def __init__(
        self,
        tokenizer: Any,
        sched_endpoint: str,
        tm_endpoint: str,
        alive: Callable[[], str | None],
    ) -> None:
        self.tokenizer = tokenizer
        self.context_length: int = tokenizer.context_length
        self._sched_endpoint, self._tm_endpoint = sched_endpoint, tm_endpoint
        self._alive = alive  # returns None while every child process lives, else why not
        self._pending: dict[str, _Pending] = {}
        self._controls: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._prefix = f"{SERVER_RID_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dead: str | None = None
        self._tasks: list[asyncio.Task] = []
        self.pd_mode = "null"  # a decode engine looks the prefill engine's scheduler up
        self._routes = RouteCache()

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(self._sched_endpoint)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._tm_endpoint)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, inp: GenerateInput) -> array:
        """The prompt's token ids as a compact array (``token_array``): converted here once,
        they cross to the scheduler and live in its ``Req`` and radix tree as they are."""
        if inp.input_ids is not None:
            ids = inp.input_ids
            vocab = getattr(self.tokenizer, "vocab_size", None)
            if vocab and len(ids) and (min(ids) < 0 or max(ids) >= vocab):  # C-speed scans
                raise RequestError(f"input_ids must be token ids in [0, {vocab})")
        elif inp.messages is not None:
            ids = self.tokenizer.encode(self.render_chat(inp), add_special_tokens=False)
        elif inp.text is not None:
            ids = self.tokenizer.encode(inp.text)
        else:
            raise RequestError("the request has no prompt (text, input_ids or messages)")
        if not len(ids):
            raise RequestError("the prompt is empty")
        try:
            return token_array(ids)
        except ValueError as e:
            raise RequestError(str(e)) from e

    def render_chat(self, inp: GenerateInput) -> str:
        """The chat prompt as text. ``continue_final_message`` (vLLM's semantics): the last
        message is left open, so that the model continues it rather than answering it."""
        assert inp.messages is not None
        if any(m.get("name") for m in inp.messages):
            self._check_names_used(inp.messages, inp.template_vars)
        if not inp.continue_final_message:
            return self.tokenizer.apply_chat_template(
                inp.messages, add_generation_prompt=inp.add_generation_prompt, **inp.template_vars
            )
        if inp.add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both "
                               "be true")  # fmt: skip
        # transformers' rule, which vLLM applies: render with a marker after the last message's
        # content and cut there (an empty content leaves the turn's header open). Searching for
        # the content itself found "end" inside "<|im_end|>".
        last = inp.messages[-1]
        content = str(last.get("content") or "")
        marked = [*inp.messages[:-1], {**last, "content": content + CONTINUE_TAG}]
        text = self.tokenizer.apply_chat_template(
            marked, add_generation_prompt=False, **inp.template_vars
        )
        at = text.rfind(CONTINUE_TAG.strip())
        if at < 0 or content.strip() not in text:
            raise RequestError("continue_final_message needs a last message that the chat "
                               "template keeps")  # fmt: skip
        return text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()

    def _check_names_used(self, messages: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        """A message's name reaches the model only through the chat template: refuse it where
        the template leaves it out, rather than drop it silently."""
        bare = [{k: v for k, v in m.items() if k != "name"} for m in messages]

        def render(ms: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(ms, add_generation_prompt=False, **extra)

        if render(bare) == render(messages):
            raise RequestError("this model's chat template does not use a message's name",
                               err_type="unsupported_parameter")  # fmt: skip

    def check_length(self, ids: Sequence[int]) -> None:
        if len(ids) >= self.context_length:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this model's context length is "
                f"{self.context_length}",
                code=400,
                err_type="context_length_exceeded",
            )

    async def generate(self, inp: GenerateInput) -> AsyncIterator[TextOut]:
        """Yield the request's TextOuts until the finished one. Cancelling the iteration (a
        client that went away) aborts the request in the scheduler and frees its KV."""
        if self.dead:
            raise EngineDeadError(self.dead)
        ids = self.tokenize(inp)
        self.check_length(ids)
        room = await self._room(inp.bootstrap) if inp.bootstrap else (None, None)
        rid = self._rid(inp.rid)
        pending = self._pending[rid] = _Pending()
        # prompt logprobs come from computing the prompt: such a request shares no cached prefix
        # (its own namespace), so every prompt token it asks about is computed for it
        space = f"prompt-logprobs:{rid}" if inp.sampling.prompt_logprobs else inp.namespace
        req = GenerateReq(rid, ids, inp.sampling, inp.priority, inp.routing_key, space)
        req.bootstrap_room, req.prefill_endpoint = room
        req.trace = TRACEPARENT.get()
        finished = False
        try:
            await self._push.send_pyobj(req)
            while not finished:
                msg = await pending.queue.get()
                if isinstance(msg, ErrorOut):
                    if msg.code == 503:
                        raise EngineDeadError(msg.message)
                    raise RequestError(msg.message, msg.code, param=msg.param)
                finished = msg.finished
                pending.last = msg
                if not inp.prefill_only:
                    yield msg
                elif finished:  # the one token sampled after the prefill is not shown
                    yield _prefill_only(msg)
        finally:
            self._pending.pop(rid, None)
            if not finished and not pending.aborted and not self.dead:
                await self._push.send_pyobj(AbortReq(rid))

    async def _room(self, bootstrap: tuple[str, int, int]) -> tuple[int | None, str | None]:
        """The room, and on a decode engine the prefill scheduler it talks to."""
        host, port, room = bootstrap
        if self.pd_mode != "decode":
            return room, None
        try:
            return room, await self._routes.endpoint(host, port)
        except ConnectionError as e:
            raise RequestError(str(e), 502, "bootstrap_unreachable", "bootstrap_host") from None

    def _rid(self, asked: str | None) -> str:
        if asked is None:
            return f"{self._prefix}-{next(self._ids)}"
        if asked.startswith(SERVER_RID_PREFIX):
            raise RequestError(f"a request id may not start with {SERVER_RID_PREFIX!r} (the "
                               "server's own ids do)", err_type="invalid_rid")  # fmt: skip
        if asked in self._pending:
            raise RequestError(f"request id {asked!r} is already in use", err_type="invalid_rid")
        return asked

    async def abort(self, rid: str | None) -> list[str]:
        """End request ``rid`` (None: every request) as SGLang's /abort_request does: its caller
        gets a last output with finish_reason "abort". Returns the ids it aborted."""
        rids = list(self._pending) if rid is None else [rid] if rid in self._pending else []
        for r in rids:
            pending = self._pending[r]
            if pending.aborted:
                continue
            pending.aborted = True
            await self._push.send_pyobj(AbortReq(r))
            pending.queue.put_nowait(_aborted(r, pending.last))
        return rids

    async def control(
        self, op: str, timeout: float = 30.0, args: dict[str, Any] | None = None
    ) -> Any:
        """Ask the scheduler process something (``flush_cache``, ``stats``,
        ``update_scheduler_settings``)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        req_id = f"ctl-{next(self._ids)}"
        fut = self._controls[req_id] = asyncio.get_running_loop().create_future()
        try:
            await self._push.send_pyobj(ControlReq(req_id, op, args))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(req_id, None)

    # -- background ---------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = await self._pull.recv_pyobj()
            if isinstance(msg, TextBatch):
                for out in msg.outputs:
                    self._deliver(out.rid, out)
            elif isinstance(msg, ErrorOut):
                self._deliver(msg.rid, msg)
            elif isinstance(msg, ControlOut):
                fut = self._controls.get(msg.req_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg.result)

    def _deliver(self, rid: str, msg: TextOut | ErrorOut) -> None:
        pending = self._pending.get(rid)
        if pending is not None:
            pending.queue.put_nowait(msg)

    async def _watch(self) -> None:
        """A dead child process fails every waiting request at once, never a hang."""
        while self.dead is None:
            await asyncio.sleep(0.5)
            self.dead = self._alive()
        for rid in list(self._pending):
            self._deliver(rid, ErrorOut(rid, f"engine process died: {self.dead}", 503))
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(f"engine process died: {self.dead}"))


def _prefill_only(out: TextOut) -> TextOut:
    return dataclasses.replace(out, text="", token_ids=[], completion_tokens=0,
                               finish_reason="length", matched_stop=None,
                               logprobs=None)  # fmt: skip


def _aborted(rid: str, last: TextOut | None) -> TextOut:
    if last is None:
        return TextOut(rid, "", [], True, "abort", 0, 0, 0)
    return dataclasses.replace(last, text="", token_ids=[], finished=True, finish_reason="abort")
