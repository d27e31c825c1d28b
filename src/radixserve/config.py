"""Frozen dataclass configs for every component; CLI flags are generated from their fields.

Each field's ``metadata["help"]`` is its help text; ``add_dataclass_args`` turns a dataclass
into an argparse group and ``from_args`` builds the dataclass back from parsed arguments.
Values derived at run time live in the components' own runtime objects, never here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class CacheConfig:
    page_size: int = _f(1, "tokens per KV page; matches and inserts are truncated to whole pages")
    radix_eviction_policy: str = _f(
        "lru",
        "radix-tree eviction order (hit-benefit: least decayed hits x tokens saved first)",
        choices=("lru", "lfu", "fifo", "mru", "filo", "priority", "hit-benefit"),
    )
    disable_radix_cache: bool = _f(False, "turn prefix reuse off (every prompt is computed whole)")
    max_total_tokens: int = _f(65536, "KV slots in the pool (tokens)")
    # SGLang's HiCache flags, same names and meanings (the storage tier is not built yet)
    enable_hierarchical_cache: bool = _f(
        False, "keep KV evicted from the device pool in a host-memory tier (HiCache)"
    )
    hicache_ratio: float | None = _f(
        None, "host tier size / device pool size, > 1 (default 2.0; with the flag above)"
    )
    hicache_size: int = _f(0, "host tier size in GB; overrides --hicache-ratio (0: use the ratio)")
    hicache_write_policy: str | None = _f(
        None,
        "when device KV is copied to the host tier (default write_through)",
        choices=("write_through", "write_through_selective", "write_back"),
    )

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens < self.page_size:
            raise ValueError("max_total_tokens must hold at least one page")
        self._check_hicache()

    def _check_hicache(self) -> None:
        given = [name for name, unset in (("--hicache-ratio", self.hicache_ratio is None),
                 ("--hicache-size", self.hicache_size == 0),
                 ("--hicache-write-policy", self.hicache_write_policy is None)) if not unset]  # fmt: skip
        if given and not self.enable_hierarchical_cache:
            raise ValueError(f"{', '.join(given)}: only with --enable-hierarchical-cache")
        if self.hicache_ratio is not None and not self.hicache_ratio > 1:
            raise ValueError(
                f"--hicache-ratio must be > 1 (the host tier holds what the device pool "
                f"evicts), got {self.hicache_ratio}"
            )
        if self.hicache_size < 0:
            raise ValueError(f"--hicache-size must be >= 0 GB, got {self.hicache_size}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache")

    @property
    def write_policy(self) -> str:
        return self.hicache_write_policy or "write_through"

    def host_tokens(self, bytes_per_token: int | None) -> int:
        """The host tier's size in tokens (0: no tier): ``hicache_size`` GB at
        ``bytes_per_token``, else ``hicache_ratio`` (2.0) times the device pool."""
        if not self.enable_hierarchical_cache:
            return 0
        if self.hicache_size and bytes_per_token:
            n = int(self.hicache_size * 1e9 // bytes_per_token)
        else:
            n = int(self.max_total_tokens * (self.hicache_ratio or 2.0))
        n -= n % self.page_size
        if n <= self.max_total_tokens:
            raise ValueError(
                f"--hicache-size {self.hicache_size} GB holds {n} tokens, not more than the "
                f"device pool's {self.max_total_tokens}"
            )
        return n


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    schedule_policy: str = _f(
        "lpm",
        "waiting-queue order",
        choices=("fcfs", "lpm", "dfs-weight", "lof", "random", "routing-key", "priority"),
    )
    max_prefill_tokens: int = _f(16384, "uncached prompt tokens admitted per prefill step")
    chunked_prefill_size: int = _f(8192, "longest prefill chunk of one request (-1: no chunking)")
    max_running_requests: int = _f(256, "most requests running at once")
    # Bounded by default: pure LPM holds a cold request back for as long as warm ones keep
    # arriving; 1 s cut that tail 3.4x at no hit-rate cost (benchmarks/max_wait_tradeoff.py)
    max_wait_ms: float | None = _f(
        1000.0,
        "a request waiting longer than this is admitted ahead of the policy's order "
        "(inf: never, pure cache order; 0: FCFS)",
    )
    enable_priority_scheduling: bool = _f(
        False, "order the waiting queue by request priority first"
    )
    priority_preemption_threshold: int | None = _f(
        None, "preempt a running request whose priority is lower by more than this (None: never)"
    )
    new_token_ratio: float = _f(0.7, "initial share of remaining new tokens reserved per decode")
    min_new_token_ratio: float = _f(0.1, "floor the reserved share decays to")
    new_token_ratio_decay: float = _f(0.001, "decay of the reserved share per decode step")
    seed: int = _f(0, "seed of the random policy")
    in_batch_prefix_threshold: int = _f(
        32,
        "cache-aware policies admit one of several waiting requests that share this many "
        "uncached tokens per step; the rest follow once it is cached (0: off)",
    )
    enable_mixed_chunk: bool = _f(
        False, "run running requests' decodes in the same step as a prefill chunk"
    )

    def __post_init__(self) -> None:
        if self.max_wait_ms == math.inf:  # the CLI's way to say "never"; None in the API
            object.__setattr__(self, "max_wait_ms", None)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = _f(None, "HF directory or .gguf file (default: built-in SmolLM2-135M)")
    dtype: str = _f("float32", "weights and KV dtype", choices=("float32", "bfloat16", "float16"))
    device: str = _f("cpu", "torch device (cpu, cuda, cuda:0, ...)")
    context_length: int | None = _f(None, "longest sequence (default: the model's)")
    weights_cache_dir: str = _f(
        "~/.cache/radixserve", "where a .gguf model is converted (dequantized) once, and reused"
    )
    sampling_seed: int = _f(0, "seed of the sampler for requests that carry no seed of their own")
    num_threads: int = _f(
        0,
        "torch CPU threads of the model (0: one per core but one, left to the API and "
        "detokenizer processes; torch's threads stall badly when they must share a core)",
    )


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Add one ``--flag-name`` per field of ``cls`` to a new argument group."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata.get("help")}
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if typing.get_origin(tp) is tuple:  # a list flag, as in sglang-router: --worker-urls A B C
            tp = typing.get_args(tp)[0]
            kw.update(nargs="*", metavar=f.metadata.get("metavar"))
        group.add_argument(flag, type=tp, **kw)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from the parsed arguments that share its field names."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})
