"""Bodies of the engine's tool and control endpoints: vLLM's /tokenize and /detokenize, and
/update_scheduler_settings, /set_internal_state and /abort_request (SGLang's names)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from radixserve.server.body_fields import StrictBody, TokenIds, unsupported
from radixserve.server.errors import ApiError
from radixserve.server.protocol import ChatMessage, Tool


class TokenizeRequest(StrictBody):
    """vLLM's /tokenize: a ``prompt``, or chat ``messages`` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: Any = unsupported("the model's own chat template is always used")
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: TokenIds


class SchedulerSettings(BaseModel):
    """What /update_scheduler_settings may change on a running engine; only the fields a
    request names change. Any other field is refused (400 naming it), never ignored."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    schedule_policy: str | None = None
    max_wait_ms: float | None = Field(None, ge=0)  # None: unbounded (pure cache order)
    enable_priority_scheduling: bool | None = None
    priority_preemption_threshold: int | None = Field(None, ge=0)

    def changes(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.model_fields_set}
        for name in ("schedule_policy", "enable_priority_scheduling"):
            if name in out and out[name] is None:
                raise ApiError(400, f"{name} cannot be null", param=name)
        return out


class InternalState(StrictBody):
    """SGLang's /set_internal_state body: the settings under ``server_args``."""

    server_args: SchedulerSettings


class AbortRequest(StrictBody):
    """SGLang's /abort_request: one request by its rid, or every request."""

    rid: str = ""
    abort_all: bool = False
