"""ServerConfig: the HTTP side of `radixserve serve` (address, auth, limits, names); the engine's
own settings stay in ModelConfig, CacheConfig and SchedulerConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.config import check_fields
from radixserve.modelfiles.sim_tokenizer import SIM_VOCAB_SIZE


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(
        30000, "port to listen on (0: any free port; the one chosen is printed)", ge=0, le=65535
    )
    sim: str | None = _f(
        None, "simulate the model with this cost-model preset (e.g. tiny-cpu), in real time"
    )
    sim_vocab_size: int = _f(
        SIM_VOCAB_SIZE,
        "with --sim: token ids of the simulated tokenizer are in [0, N) (N - 1: EOS)",
        ge=3,
    )
    served_model_name: str | None = _f(
        None,
        "the model name clients send and see (default: the GGUF's file name without .gguf, "
        "the model directory's name, or sim-PRESET with --sim)",
    )
    api_key: str | None = _f(
        None, "bearer key required on every endpoint but /health*, /get_loads, /metrics"
    )
    admin_api_key: str | None = _f(
        None, "bearer key of the admin endpoints (/set_internal_state, ...) instead of api_key"
    )
    max_payload_size: int = _f(32 * 2**20, "largest request body in bytes (larger: 413)", ge=1)
    max_batch_size: int = _f(256, "most choices one request may ask for (prompts x n)", ge=1)
    health_generate_timeout_secs: float = _f(
        20.0, "a /health_generate probe slower than this reports the engine unhealthy", gt=0
    )
    log_level: str = _f(
        "info", "log level", choices=("critical", "error", "warning", "info", "debug")
    )
    access_log: bool = _f(False, "log every HTTP request (costs CPU under load)")
    tool_call_parser: str = _f(
        "auto",
        "format of the model's tool calls (auto: from the chat template; smollm2 where the "
        "template knows no tools, as the default tools prompt asks for it)",
        choices=("auto", "hermes", "qwen25", "llama3", "pythonic", "mistral", "smollm2"),
    )
    reasoning_parser: str | None = _f(
        None,
        "split the model's <think> reasoning off into reasoning_content",
        choices=("qwen3", "deepseek-r1"),
    )
    graceful_shutdown_secs: float = _f(
        5.0, "once told to stop, requests still running after this end with a 503", ge=0
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.sim_vocab_size != SIM_VOCAB_SIZE and self.sim is None:  # refused, not ignored
            raise ValueError("--sim-vocab-size needs --sim (a real model has its own vocabulary)")
        if self.sim is not None:  # an unknown preset: one line here, not a scheduler traceback
            from radixserve.sim.costmodel import get_cost_model

            get_cost_model(self.sim)

    def public(self) -> dict[str, Any]:
        """Settings safe to show on /get_server_info (no secrets)."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["api_key"] = "***" if self.api_key else None
        out["admin_api_key"] = "***" if self.admin_api_key else None
        return out
