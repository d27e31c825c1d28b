"""Request bodies of the OpenAI-compatible and SGLang-style endpoints, validated strictly (a
string where a number belongs is a 400, not a guess), and their OpenAPI schema."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

# Bounded so that no value can overflow an int64 tensor in the model process.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TokenIds = list[TokenId]
TopK = Annotated[int, Field(ge=-1, lt=2**31)]
Stop = str | list[str] | None


def cache_namespace(body: Any) -> str | None:
    """The prefix-cache namespace of a request: requests with different ``cache_salt`` values
    never share cached KV (vLLM's semantics); the router keys its tree the same way. LoRA
    adapters are not served yet, so naming one is refused rather than silently ignored."""
    if body.lora_path:
        from radixserve.server.errors import ApiError

        raise ApiError(400, "LoRA adapters are not supported by this server", param="lora_path")
    return f"salt:{body.cache_salt}" if body.cache_salt else None


def scheduling_fields(body: Any) -> dict[str, Any]:
    """What the scheduler reads of a request besides its prompt and sampling: the cache
    namespace, ``priority`` (with ``--enable-priority-scheduling``) and ``routing_key`` (for
    ``--schedule-policy routing-key``), SGLang's names for both."""
    return {
        "namespace": cache_namespace(body),
        "priority": body.priority,
        "routing_key": body.routing_key,
    }


Priority = Annotated[int, Field(ge=-(2**31), lt=2**31)]
RoutingKey = Annotated[str | None, Field(max_length=256)]


class _Body(BaseModel):
    # Unknown fields are ignored (OpenAI clients send many we do not use); declared ones are
    # checked without coercion, and NaN or infinite numbers are refused.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The sampling fields every endpoint takes, under the same names and limits."""

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = -1
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False

    def _seed(self) -> int | None:
        return self.seed

    def sampling(self, max_new_tokens: int | None) -> dict[str, Any]:
        """Keyword arguments for ``sampling_from`` (SGLang's names)."""
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self._seed(),
            "stop": self.stop or (),
            "stop_token_ids": self.stop_token_ids or (),
            "ignore_eos": self.ignore_eos,
        }


class _OpenAISampling(_Sampling):
    """Fields shared by /v1/completions and /v1/chat/completions (plus SGLang's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, max_length=256)
    lora_path: str | None = None
    priority: Priority = 0
    routing_key: RoutingKey = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False


class GenerateSampling(_Sampling):
    """SGLang's ``sampling_params``; ``sampling_seed`` is SGLang's name for ``seed``."""

    max_new_tokens: int | None = Field(None, ge=1)
    sampling_seed: int | None = None

    def _seed(self) -> int | None:
        return self.seed if self.seed is not None else self.sampling_seed


class GenerateRequest(_Body):
    """SGLang's /generate: one prompt (``text`` or ``input_ids``) or a batch of them."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: GenerateSampling | list[GenerateSampling] | None = None
    stream: bool = False
    rid: str | None = None
    cache_salt: str | None = Field(None, max_length=256)
    lora_path: str | None = None
    priority: Priority = 0
    routing_key: RoutingKey = None


BODIES: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    GenerateRequest,
)


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads and validates its JSON body itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_body_schemas(openapi: dict[str, Any]) -> dict[str, Any]:
    """Put the request bodies' JSON schemas into an OpenAPI document's components."""
    _, top = models_json_schema(
        [(m, "validation") for m in BODIES], ref_template="#/components/schemas/{model}"
    )
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(top.get("$defs", {}))
    return openapi
