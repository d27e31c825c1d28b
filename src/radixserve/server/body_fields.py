"""What every request body shares: strict validation (a string where a number belongs is a 400,
not a guess), the bounded field types, the sampling fields every endpoint takes, and how a field
the server does not honour is declared and refused with a 400 naming it."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from radixserve.server.errors import ApiError
from radixserve.server.sampling_args import grammar_of, logit_bias_pairs

# Bounded so that no value can overflow an int64 tensor in the model process.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TokenIds = list[TokenId]
TopK = Annotated[int, Field(ge=-1, lt=2**31)]
Stop = str | list[str] | None
Priority = Annotated[int, Field(ge=-(2**31), lt=2**31)]
RoutingKey = Annotated[str | None, Field(max_length=256)]
Room = Annotated[int, Field(ge=0, lt=2**64)]
Port = Annotated[int, Field(ge=1, le=65535)]
BootstrapHost = str | list[str] | None
BootstrapPort = Port | list[Port | None] | None
BootstrapRoom = Room | list[Room] | None
UNSUPPORTED = "unsupported"  # json_schema_extra key: why the server refuses the field


def unsupported(why: str, default: Any = None, accept: tuple[Any, ...] = ()) -> Any:
    """Declare a field of OpenAI's or SGLang's schema that this server does not honour: a
    request that sets it to anything but ``default`` (or one of ``accept``) gets a 400 naming
    it. Declaring it (rather than letting ``extra="ignore"`` drop it) is what keeps it from
    being silently ignored; to honour it, give it a real type and use it."""
    extra = {UNSUPPORTED: why, "accept": [default, *accept]}
    return Field(default, json_schema_extra=extra)  # type: ignore[arg-type]


def refused(model: type[BaseModel]) -> dict[str, str]:
    """The fields of ``model`` declared with ``unsupported``: name -> why."""
    return {
        name: f.json_schema_extra[UNSUPPORTED]  # type: ignore[index]
        for name, f in model.model_fields.items()
        if isinstance(f.json_schema_extra, dict) and UNSUPPORTED in f.json_schema_extra
    }


def check_supported(body: BaseModel, prefix: str = "") -> None:
    """Refuse (400 naming the field, with its dotted path) the first unsupported field that
    ``body`` or a model nested in it sets to a value the server cannot honour."""
    for name, f in type(body).model_fields.items():
        value = getattr(body, name)
        extra = f.json_schema_extra
        if isinstance(extra, dict) and UNSUPPORTED in extra and not _accepted(value, extra):
            raise ApiError(400, f"{prefix}{name} is not supported by this server: "
                           f"{extra[UNSUPPORTED]}", "unsupported_parameter", prefix + name)  # fmt: skip
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel):
                at = f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}."
                check_supported(item, at)


def _accepted(value: Any, extra: dict[str, Any]) -> bool:
    # 0 == False in Python; a JSON false is not the number 0 here
    return any(value == a and isinstance(value, bool) == isinstance(a, bool)
               for a in extra["accept"])  # fmt: skip


NOT_YET = "not implemented yet"
NO_GRAMMAR = "structured output (a grammar engine) is not implemented yet"
NO_LOGPROBS = "log probabilities are not returned yet"
NO_TOOLS = "the deprecated functions API is not served: send tools and tool_choice"
NO_MEDIA = "this server serves text-only models"
NO_LORA = "LoRA adapters are not supported by this server"


Bias = Annotated[float, Field(ge=-100, le=100)]
MAX_TOP_LOGPROBS = 20  # as vLLM's default --max-logprobs


class StrictBody(BaseModel):
    # Unknown fields are ignored (OpenAI clients send many we do not use); declared ones are
    # checked without coercion, and NaN or infinite numbers are refused.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class SamplingFields(StrictBody):
    """The sampling fields every endpoint takes, under the same names and limits."""

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = -1
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    # SGLang's sampling params (also accepted by its and vLLM's OpenAI routes)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: dict[str, Bias] | None = None  # token id (as a JSON key) -> bias
    skip_special_tokens: bool = True
    spaces_between_special_tokens: Any = unsupported("special tokens are never shown", True)
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: Any = unsupported(NO_GRAMMAR)
    structural_tag: Any = unsupported(NO_GRAMMAR)

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
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": logit_bias_pairs(self.logit_bias),
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "grammar": self._grammar(),
        }

    def _grammar(self) -> tuple[str, str] | None:
        return grammar_of(json_schema=self.json_schema, regex=self.regex)
