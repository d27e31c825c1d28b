"""Request bodies of the OpenAI-compatible and SGLang-style generation endpoints (completions,
chat with its tools, /generate) and what the server reads of a request besides its sampling:
its cache namespace, scheduling fields and PD bootstrap. Shared field rules: body_fields.py."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from radixserve.server.body_fields import (
    MAX_TOP_LOGPROBS,
    NO_GRAMMAR,
    NO_LOGPROBS,
    NO_LORA,
    NO_MEDIA,
    NO_TOOLS,
    NOT_YET,
    BootstrapHost,
    BootstrapPort,
    BootstrapRoom,
    Priority,
    RoutingKey,
    SamplingFields,
    StrictBody,
    TokenIds,
    unsupported,
)
from radixserve.server.errors import ApiError
from radixserve.server.sampling_args import grammar_of


def cache_namespace(body: Any) -> str | None:
    """The prefix-cache namespace of a request: requests with different ``cache_salt`` values
    never share cached KV (vLLM's semantics); the router keys its tree the same way. LoRA
    adapters are not served yet (``lora_path`` is refused by ``check_supported``)."""
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


DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's, where a router sends none


def bootstraps(body: Any, count: int) -> list[tuple[str, int, int] | None]:
    """SGLang's ``bootstrap_host/port/room`` for each of ``count`` requests: scalars (one room
    for one request; room + i for the i-th of several, as for ``n`` > 1) or lists of one
    each. All None: the request is not disaggregated."""
    host, port, room = body.bootstrap_host, body.bootstrap_port, body.bootstrap_room
    if room is None:
        if host is not None or port is not None:
            raise ApiError(400, "bootstrap_host and bootstrap_port need bootstrap_room",
                           param="bootstrap_room")  # fmt: skip
        return [None] * count
    rooms = _each(room, count, "bootstrap_room", lambda i: room + i)
    hosts = _each(host, count, "bootstrap_host", lambda i: host)
    ports = _each(port, count, "bootstrap_port", lambda i: port)
    return [(h or "", p or DEFAULT_BOOTSTRAP_PORT, r) for h, p, r in zip(hosts, ports, rooms)]


def _each(value: Any, count: int, name: str, nth: Any) -> list[Any]:
    if not isinstance(value, list):
        return [nth(i) for i in range(count)]
    if len(value) != count:
        raise ApiError(400, f"{name} has {len(value)} entries for {count} requests", param=name)
    return value


class StreamOptions(StrictBody):
    include_usage: bool = False


class JsonSchemaFormat(StrictBody):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(StrictBody):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON that a schema allows."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _OpenAISampling(SamplingFields):
    """Fields shared by /v1/completions and /v1/chat/completions (plus SGLang's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, max_length=256)
    lora_path: Any = unsupported(NO_LORA)
    priority: Priority = 0
    routing_key: RoutingKey = None
    # SGLang's prefill/decode fields, as its routers fill them
    bootstrap_host: BootstrapHost = None
    bootstrap_port: BootstrapPort = None
    bootstrap_room: BootstrapRoom = None
    # informational: identify the end user or the cache bucket; nothing to apply
    user: str | None = None
    # vLLM's extensions
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    best_of: Any = unsupported(NOT_YET, None, (1,))
    response_format: ResponseFormat | None = None
    guided_json: Any = unsupported(NO_GRAMMAR)
    guided_regex: Any = unsupported(NO_GRAMMAR)
    guided_choice: Any = unsupported(NO_GRAMMAR)
    guided_grammar: Any = unsupported(NO_GRAMMAR)
    structured_outputs: Any = unsupported(NO_GRAMMAR)
    use_beam_search: Any = unsupported("beam search is not implemented", False)
    length_penalty: Any = unsupported("beam search is not implemented", 1.0)
    prompt_logprobs: Any = unsupported(NO_LOGPROBS)
    truncate_prompt_tokens: Any = unsupported("prompts are never truncated; a long one is a 400")
    return_hidden_states: Any = unsupported("hidden states are not returned", False)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_new_tokens: int | None) -> dict[str, Any]:
        """SGLang's sampling keywords, with vLLM's and OpenAI's names mapped onto them."""
        out = super().sampling(max_new_tokens)
        out["min_new_tokens"] = self.min_tokens
        out["no_stop_trim"] = self.include_stop_str_in_output or self.no_stop_trim
        return out

    def _grammar(self) -> tuple[str, str] | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return super()._grammar()
        if self.json_schema is not None or self.regex is not None:
            raise ApiError(400, "give response_format or json_schema/regex, not both",
                           param="response_format")  # fmt: skip
        if fmt.type == "json_object":
            return grammar_of(any_json=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema",
                           param="response_format.json_schema")  # fmt: skip
        return ("json_schema", json.dumps(fmt.json_schema.schema_))


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: Any = unsupported("insertion (text after the completion) is not implemented")
    add_special_tokens: Any = unsupported("the tokenizer's special tokens are always added", True)

    def sampling(self, max_new_tokens: int | None) -> dict[str, Any]:
        out = super().sampling(max_new_tokens)
        if self.logprobs is not None:  # with echo, the prompt's too (from its second token)
            out |= {"return_logprob": True, "top_logprobs_num": self.logprobs,
                    "logprob_start_len": 0 if self.echo else -1}  # fmt: skip
        return out


class ContentPart(StrictBody):
    type: str
    text: str | None = None


class FunctionCall(StrictBody):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallIn(StrictBody):
    """A call in a past assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # a past assistant turn's reasoning, handed to the template (which renders it or not)
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for it
    function_call: Any = unsupported(NO_TOOLS)
    refusal: Any = unsupported("a refusal in the history has no place in the chat template")
    audio: Any = unsupported(NO_MEDIA)


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionDef(StrictBody):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # a forced call always follows the schema, strict or not


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: auto with tools, none without
    parallel_tool_calls: bool = True
    functions: Any = unsupported(NO_TOOLS, None, ([],))
    function_call: Any = unsupported(NO_TOOLS, None, ("none",))
    audio: Any = unsupported(NO_MEDIA)
    modalities: Any = unsupported(NO_MEDIA, None, (["text"],))
    prediction: Any = unsupported("predicted outputs (speculative decoding) are not implemented")
    reasoning_effort: Any = unsupported("the served models have no reasoning budget")
    verbosity: Any = unsupported("the served models have no verbosity setting")
    web_search_options: Any = unsupported("this server cannot search the web")
    store: Any = unsupported("completions are never stored", False)
    service_tier: Any = unsupported("one tier only", None, ("auto", "default"))
    # informational: tags and identifiers; nothing to apply
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's chat extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: Any = unsupported("echoing the last message is not implemented", False)
    chat_template: Any = unsupported("the model's own chat template is always used")
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Any = unsupported("the chat template takes no documents")
    separate_reasoning: bool = True  # SGLang's: with --reasoning-parser, reasoning apart

    def sampling(self, max_new_tokens: int | None) -> dict[str, Any]:
        out = super().sampling(max_new_tokens)
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.logprobs:
            out |= {"return_logprob": True, "top_logprobs_num": self.top_logprobs or 0}
        return out


class GenerateSampling(SamplingFields):
    """SGLang's ``sampling_params``; ``sampling_seed`` is SGLang's name for ``seed``."""

    max_new_tokens: int | None = Field(None, ge=0)  # 0: prefill (and cache) the prompt only
    sampling_seed: int | None = None
    min_new_tokens: int = Field(0, ge=0)
    n: Any = unsupported("send a batch of prompts instead", 1)
    stop_regex: Any = unsupported("stop patterns are plain strings", None, ([],))
    custom_params: Any = unsupported("custom logit processors are not supported")

    def _seed(self) -> int | None:
        return self.seed if self.seed is not None else self.sampling_seed

    def sampling(self, max_new_tokens: int | None) -> dict[str, Any]:
        return super().sampling(max_new_tokens) | {"min_new_tokens": self.min_new_tokens}


class GenerateRequest(StrictBody):
    """SGLang's /generate: one prompt (``text`` or ``input_ids``) or a batch of them."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: GenerateSampling | list[GenerateSampling] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    cache_salt: str | None = Field(None, max_length=256)
    lora_path: Any = unsupported(NO_LORA)
    priority: Priority = 0
    routing_key: RoutingKey = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    token_ids_logprob: Any = unsupported(NO_LOGPROBS)
    return_text_in_logprobs: bool = False
    input_embeds: Any = unsupported("prompts are text or token ids")
    image_data: Any = unsupported(NO_MEDIA)
    audio_data: Any = unsupported(NO_MEDIA)
    video_data: Any = unsupported(NO_MEDIA)
    custom_logit_processor: Any = unsupported("custom logit processors are not supported")
    return_hidden_states: Any = unsupported("hidden states are not returned", False)
    session_params: Any = unsupported("sessions are not implemented")
    bootstrap_host: BootstrapHost = None
    bootstrap_port: BootstrapPort = None
    bootstrap_room: BootstrapRoom = None
    data_parallel_rank: Any = unsupported("one engine per server; route with radixserve route")

    def logprob_args(self, i: int, count: int) -> dict[str, Any]:
        """SamplingParams keywords for prompt ``i`` of ``count``: ``return_logprob`` may be one
        flag or one per prompt."""
        asked = self.return_logprob
        if isinstance(asked, list):
            if len(asked) != count:
                raise ApiError(400, f"return_logprob has {len(asked)} entries for {count} "
                               "prompts", param="return_logprob")  # fmt: skip
            asked = asked[i]
        if not asked:
            return {}
        return {"return_logprob": True, "top_logprobs_num": self.top_logprobs_num,
                "logprob_start_len": self.logprob_start_len}  # fmt: skip
