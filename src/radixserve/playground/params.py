"""The playground's settings: one frozen record, its defaults and limits, and the parser that turns
a page's JSON into it or refuses it with an error that names the field."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import SchedulerConfig
from radixserve.sched.policy import POLICIES

# the server's default bound (`radixserve serve --max-wait-ms`), so that the page starts where a
# server does; the page says so beside the slider
SERVER_MAX_WAIT_MS = SchedulerConfig().max_wait_ms
# the most prompt tokens one run may simulate: beyond it a sweep takes minutes, not seconds
MAX_PROMPT_TOKENS = 1_000_000


def _p(default: Any, lo: float, hi: float, help: str) -> Any:
    return field(default=default, metadata={"lo": lo, "hi": hi, "help": help})


@dataclass(frozen=True, slots=True)
class Params:
    """A workload (the shared-prefix mix of ``radixserve sim --workload shared-prefix-mix``) and
    one simulated engine. Defaults are sized so that every view answers in about a second."""

    shared_prob: float = _p(0.9, 0, 1, "probability that a request extends a shared prompt")
    num_prefixes: int = _p(8, 1, 256, "shared system prompts")
    system_prompt_len: int = _p(256, 1, 16384, "tokens of each system prompt")
    question_len: int = _p(16, 0, 16384, "tokens after the system prompt")
    output_len: int = _p(8, 1, 4096, "tokens generated per request")
    request_rate: float = _p(100.0, 0.01, 10000, "Poisson arrivals per second")
    num_requests: int = _p(100, 1, 5000, "requests in the stream")
    kv_tokens: int = _p(1200, 16, 4_000_000, "KV pool of the engine, in tokens")
    max_running_requests: int = _p(8, 1, 1024, "most requests running at once")
    max_wait_ms: float | None = _p(
        SERVER_MAX_WAIT_MS, 0, 3_600_000, "fairness bound (null: unbounded); default: the server's"
    )
    policies: tuple[str, ...] = field(
        default=("fcfs", "lpm"), metadata={"help": "schedule policies to compare"}
    )
    sweep_policy: str = field(
        default="lpm", metadata={"help": "cache-aware policy whose fairness bound is swept"}
    )
    seed: int = _p(0, 0, 2**31 - 1, "seed of the workload")

    def prompt_len(self) -> int:
        return self.system_prompt_len + self.question_len


class ParamError(ValueError):
    """A setting the playground refuses; ``param`` names it for the error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


FIELDS = {f.name: f for f in dataclasses.fields(Params)}


def describe() -> dict[str, Any]:
    """Defaults, limits and help of every setting, and the policies one may compare."""
    out: dict[str, Any] = {}
    for name, f in FIELDS.items():
        meta = dict(f.metadata)
        out[name] = {"default": f.default, **meta}
    out["policies"]["choices"] = sorted(POLICIES)
    out["sweep_policy"]["choices"] = sorted(POLICIES)
    return out


def parse(body: Any) -> Params:
    """A JSON object of settings (any subset) -> Params, or ParamError naming the bad one."""
    if not isinstance(body, dict):
        raise ParamError("body", "the body must be a JSON object of settings")
    if unknown := sorted(set(body) - set(FIELDS)):
        raise ParamError(unknown[0], f"unknown setting(s): {', '.join(unknown)}")
    values = {name: _value(name, v) for name, v in body.items()}
    params = Params(**values)
    _check_whole(params)
    return params


def _value(name: str, v: Any) -> Any:
    if name == "policies":
        return _policies(v)
    if name == "sweep_policy":
        return _policy(name, v)
    if name == "max_wait_ms" and v is None:
        return None
    f = FIELDS[name]
    want_int = f.type in ("int", int)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ParamError(name, f"{name} must be a number, got {v!r}")
    if want_int and not float(v).is_integer():
        raise ParamError(name, f"{name} must be a whole number, got {v!r}")
    lo, hi = f.metadata["lo"], f.metadata["hi"]
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ParamError(name, f"{name} must be between {lo:g} and {hi:g}, got {v!r}")
    return int(v) if want_int else float(v)


def _policy(name: str, v: Any) -> str:
    if v not in POLICIES:
        known = ", ".join(sorted(POLICIES))
        raise ParamError(name, f"{name}: unknown policy {v!r}; known: {known}")
    return v


def _policies(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not v:
        raise ParamError("policies", "policies must be a non-empty list of policy names")
    return tuple(dict.fromkeys(_policy("policies", p) for p in v))


def _check_whole(p: Params) -> None:
    """Limits that involve several settings."""
    need = p.prompt_len() + p.output_len
    if p.kv_tokens < need:
        raise ParamError(
            "kv_tokens",
            f"kv_tokens={p.kv_tokens} cannot hold one request "
            f"({p.prompt_len()} prompt + {p.output_len} output tokens = {need})",
        )
    if p.num_requests * p.prompt_len() > MAX_PROMPT_TOKENS:
        raise ParamError(
            "num_requests",
            f"num_requests x prompt length = {p.num_requests * p.prompt_len():,} tokens; "
            f"the playground simulates at most {MAX_PROMPT_TOKENS:,} per run",
        )
