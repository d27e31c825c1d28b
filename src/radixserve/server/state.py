"""What every route of one server shares: its config, the engine and its tokenizer manager, the
metrics; and the checks that turn a request into engine inputs (auth, body, model, length)."""

from __future__ import annotations

import dataclasses
import hmac
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from radixserve.engine.engine import sampling_from
from radixserve.engine.launch import EngineProcesses
from radixserve.engine.tokenizer_manager import GenerateInput, RequestError, TokenizerManager
from radixserve.sched.policy import orders_by_priority
from radixserve.sched.request import SamplingParams, needs_logits
from radixserve.server.body_fields import check_supported
from radixserve.server.chat_io import tool_parser_name
from radixserve.server.config import ServerConfig
from radixserve.server.errors import ApiError
from radixserve.server.metrics import ServerMetrics
from radixserve.server.streams import Generation

M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerState:
    config: ServerConfig
    engine: EngineProcesses
    tm: TokenizerManager
    metrics: ServerMetrics
    model_name: str
    window: int  # most tokens one request may hold: the context, or the KV pool if smaller
    started: float
    live: set[Generation] = field(default_factory=set)  # requests now generating
    priority_scheduling: bool = False  # as the scheduler now runs (settings change at run time)
    tool_parser: str | None = None  # the tool-call format (--tool-call-parser, or the template's)

    @classmethod
    def create(cls, config: ServerConfig, engine: EngineProcesses) -> ServerState:
        ep, info = engine.endpoints, engine.info
        tm = TokenizerManager(engine.tokenizer, ep.sched, ep.tm, engine.why_dead)
        name = config.served_model_name or str(info.get("model") or engine.tokenizer.name)
        window = min(tm.context_length, int(info.get("max_total_tokens") or tm.context_length))
        state = cls(config, engine, tm, ServerMetrics(), name, window, time.time())
        template = getattr(engine.tokenizer, "chat_template", None)
        state.tool_parser = tool_parser_name(config.tool_call_parser, template)
        state.note_settings(dataclasses.asdict(engine.config.sched))
        tm.pd_mode = engine.config.disagg.disaggregation_mode
        return state

    def note_settings(self, sched: dict[str, Any]) -> None:
        """Remember what the scheduler's live settings mean for requests."""
        self.priority_scheduling = orders_by_priority(
            sched["schedule_policy"], sched["enable_priority_scheduling"]
        )

    def dead(self) -> str | None:
        """Why the engine cannot serve, or None while it can."""
        return self.tm.dead or self.engine.why_dead()

    def authorize(self, request: Request) -> None:
        """FastAPI dependency: the bearer key, when the server has one."""
        self._check_key(request, self.config.api_key)

    def authorize_admin(self, request: Request) -> None:
        """FastAPI dependency of the admin endpoints: the admin key, else the API key."""
        self._check_key(request, self.config.admin_api_key or self.config.api_key)

    def _check_key(self, request: Request, key: str | None) -> None:
        if key is None:
            return
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, f"Bearer {key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                           "invalid_api_key")  # fmt: skip

    def check_model(self, name: str | None) -> None:
        # "unknown" is what SGLang's routers send for a request that named no model
        if name is None or name in (self.model_name, self.engine.config.model.model, "default",
                                    "unknown"):  # fmt: skip
            return
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                       f"{self.model_name!r}", "model_not_found", "model")  # fmt: skip

    def check_priority(self, priority: int) -> None:
        """A priority only orders requests under priority scheduling: else it is refused."""
        if priority and not self.priority_scheduling:
            raise ApiError(400, "priority is not used by this server's scheduler (start it with "
                           "--enable-priority-scheduling or --schedule-policy priority, or turn "
                           "it on with /update_scheduler_settings)", "unsupported_parameter",
                           "priority")  # fmt: skip

    def check_batch(self, count: int) -> None:
        if count > self.config.max_batch_size:
            raise ApiError(400, f"{count} choices asked for; at most "
                           f"{self.config.max_batch_size} per request", param="n")  # fmt: skip

    def prepare(
        self, inp: GenerateInput, sampling: dict[str, Any], default_max: int | None,
        params: tuple[str, str], names: Mapping[str, str] | None = None,
    ) -> GenerateInput:  # fmt: skip
        """Tokenize ``inp`` and fix its sampling; ``default_max`` applies when the client set no
        limit (None: up to the context). ``params`` names the prompt and the limit fields."""
        ids = self._tokenize(inp, params[0])
        room = self.window - len(ids)
        asked = sampling["max_new_tokens"]
        if room < 1 or (asked is not None and asked > room):
            raise ApiError(400, self._too_long(len(ids), asked), "context_length_exceeded",
                           params[0] if room < 1 else params[1])  # fmt: skip
        if asked is None:
            asked = room if default_max is None else min(default_max, room)
        try:  # max_new_tokens 0 (prefill only) samples one token that is never shown
            sp = sampling_from({**sampling, "max_new_tokens": max(asked, 1)})
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e)) from e
        self._check_sampling(sp, names or {})
        return dataclasses.replace(inp, text=None, messages=None, input_ids=ids, sampling=sp,
                                   prefill_only=asked == 0)  # fmt: skip

    def _check_sampling(self, sp: SamplingParams, names: Mapping[str, str]) -> None:
        """Token ids in ``logit_bias`` must be in the vocabulary; a simulated engine has no
        logits, so it refuses every field that needs them (named as the client named it)."""
        vocab = getattr(self.tm.tokenizer, "vocab_size", None)
        if vocab and any(t >= vocab for t, _ in sp.logit_bias):
            raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab})",
                           param="logit_bias")  # fmt: skip
        if self.engine.config.sim is None:
            return
        field = needs_logits(sp)
        if field is not None:
            name = names.get(field, field)
            raise ApiError(400, f"{name} needs a model's logits; a --sim engine has none",
                           "unsupported_parameter", name)  # fmt: skip

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (for logprobs)."""
        return self.tm.tokenizer.decode([token], skip_special_tokens=False)

    def visible_text(self, token: int) -> str:
        return self.tm.tokenizer.decode([token], skip_special_tokens=True)

    def _tokenize(self, inp: GenerateInput, param: str) -> Sequence[int]:
        try:
            return self.tm.tokenize(inp)
        except RequestError as e:
            raise ApiError.from_engine(e, param) from e
        except Exception as e:  # a chat template that refuses the conversation, for one
            raise ApiError(400, f"cannot tokenize the prompt: {e}", param=param) from e

    def _too_long(self, prompt: int, asked: int | None) -> str:
        what = "context length" if self.window == self.tm.context_length else "KV pool size"
        total = prompt + (asked or 0)
        return (f"this request needs {total} tokens ({prompt} in the prompt, {asked or 0} to "
                f"generate); the model's {what} allows {self.window}")  # fmt: skip

    def with_bootstrap(
        self, inputs: list[GenerateInput], boots: list[tuple[str, int, int] | None]
    ) -> list[GenerateInput]:
        """Each input with its room; a 400 where the engine's role and the fields disagree."""
        mode = self.engine.config.disagg.disaggregation_mode
        if mode == "null" and any(boots):
            raise ApiError(
                400,
                "bootstrap_room is for prefill and decode engines (this one was "
                "started without --disaggregation-mode)",
                param="bootstrap_room",
            )
        if mode != "null" and not all(boots):
            raise ApiError(
                400,
                f"a {mode} engine serves requests with bootstrap_room (and on "
                "a decode engine bootstrap_host and bootstrap_port): a PD router "
                "fills them",
                param="bootstrap_room",
            )
        if mode == "decode" and not all(b and b[0] for b in boots):
            raise ApiError(
                400,
                "a decode engine needs bootstrap_host (the prefill engine's host)",
                param="bootstrap_host",
            )
        rooms = [b[2] for b in boots if b]
        if len(set(rooms)) != len(rooms):
            raise ApiError(
                400, "the bootstrap_rooms of one request must differ", param="bootstrap_room"
            )
        return [dataclasses.replace(i, bootstrap=b) for i, b in zip(inputs, boots)]

    def start(self, inputs: Sequence[GenerateInput], start: float) -> Generation:
        """Send ``inputs`` to the engine (``check_batch`` passed before they were prepared);
        the caller must ``close()`` what this returns."""
        tracks = [self.metrics.track(start) for _ in inputs]
        return Generation(self.tm, inputs, tracks, self.live)

    def fail_all(self, message: str) -> int:
        """End every request still generating with a 503; returns how many there were."""
        live = list(self.live)
        for gen in live:
            gen.fail(RequestError(message, 503, "server_shutting_down"))
        return len(live)


async def read_json(request: Request, model: type[M], limit: int) -> M:
    """The body, at most ``limit`` bytes, parsed as JSON and validated as ``model``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, f"the body is not valid JSON: {e}", "invalid_json") from e
    body = model.model_validate(data)
    check_supported(body)
    return body


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the body is larger than {limit} bytes", "payload_too_large")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
