"""Frozen dataclass configs of the engine's components (cache, scheduler, model, prefill/decode
disaggregation, traces); CLI flags are generated from their fields.

Each field's ``metadata["help"]`` is its help text; ``add_dataclass_args`` (config_flags.py) turns
a dataclass into an argparse group and ``from_args`` builds the dataclass back from parsed
arguments. Values derived at run time live in the components' own runtime objects, never here.

A field's bounds live in its metadata (``ge``, ``gt``, ``le``, ``lt``; ``also``: values allowed
besides, such as -1 for "off"; ``check``: a function naming what is wrong with a value, run on
the command line only, where it may look at files: config_checks.py). ``check_fields``
(config_bounds.py) applies the bounds in ``__post_init__``; the flags apply them while parsing,
and ``CliParser`` builds every config right after parsing, so a bad value is one line and exit
status 2 before any process starts. This module re-exports those helpers: import them from here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from radixserve.config_bounds import bound_problem, check_fields  # noqa: F401  (re-exported)
from radixserve.config_checks import (  # noqa: F401  (writable_file re-exported)
    device_problem,
    dir_problem,
    writable_file,
)
from radixserve.config_flags import (  # noqa: F401  (re-exported: the flags made from configs)
    CliParser,
    add_check,
    add_dataclass_args,
    bounded,
    choices_of,
    flag_names,
    from_args,
    from_flags,
    lazy_attr,
    with_flags,
)


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class CacheConfig:
    page_size: int = _f(
        1, "tokens per KV page; matches and inserts are truncated to whole pages", ge=1
    )
    radix_eviction_policy: str = _f(
        "lru",
        "radix-tree eviction order (hit-benefit: least decayed hits x tokens saved first)",
        choices="radixserve.cache.evict:POLICIES",
    )
    disable_radix_cache: bool = _f(False, "turn prefix reuse off (every prompt is computed whole)")
    max_total_tokens: int = _f(65536, "KV slots in the pool (tokens)", ge=1)
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
    hicache_storage_backend: str | None = _f(
        None,
        "a third tier below the host tier: KV pages written once to a store shared by engines, "
        "prefetched into the host tier (needs --enable-hierarchical-cache)",
        choices=("mooncake", "file"),
    )
    hicache_storage_backend_extra_config: str | None = _f(
        None,
        "JSON: the backend's settings (mooncake: master_server_address, te_port_range, "
        "client_port_range, ...; file: path) plus chunk_size, hash_algo, seed, write_queue_pages",
    )
    hicache_storage_prefetch_policy: str | None = _f(
        None,
        "how long a request waits for its storage prefetch (default best_effort; timeout: "
        "2 s + 0.1 s per 1k tokens, at most 30 s)",
        choices=("best_effort", "wait_complete", "timeout"),
    )

    def __post_init__(self) -> None:
        check_fields(self)
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
        storage = [name for name, unset in (
            ("--hicache-storage-backend-extra-config", self.hicache_storage_backend_extra_config is None),
            ("--hicache-storage-prefetch-policy", self.hicache_storage_prefetch_policy is None)) if not unset]  # fmt: skip
        if storage and self.hicache_storage_backend is None:
            raise ValueError(f"{', '.join(storage)}: only with --hicache-storage-backend")
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ValueError("--hicache-storage-backend: only with --enable-hierarchical-cache "
                             "(pages come back through the host tier)")  # fmt: skip
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
        choices="radixserve.sched.policy:POLICIES",  # the registry (it imports this module)
    )
    # None: by device (``for_device``): a GPU keeps SGLang's budgets, a CPU takes smaller ones
    max_prefill_tokens: int | None = _f(
        None,
        "uncached prompt tokens admitted per prefill step (default: 1024 on a CPU, half "
        "vLLM-CPU's token budget; 16384 on a GPU, as SGLang)",
        ge=1,
    )
    chunked_prefill_size: int | None = _f(
        None,
        "longest prefill chunk of one request (-1: no chunking; default: 1024 on a CPU, "
        "8192 on a GPU)",
        ge=1,
        also=(-1,),
    )
    max_running_requests: int = _f(256, "most requests running at once", ge=1)
    # Bounded by default: pure LPM holds a cold request back for as long as warm ones keep
    # arriving; 1 s cut that tail 3.4x at no hit-rate cost (benchmarks/max_wait_tradeoff.py)
    max_wait_ms: float | None = _f(
        1000.0,
        "a request waiting longer than this is admitted ahead of the policy's order "
        "(inf: never, pure cache order; 0: FCFS)",
        ge=0,
    )
    enable_priority_scheduling: bool = _f(
        False, "order the waiting queue by request priority first"
    )
    priority_preemption_threshold: int | None = _f(
        None,
        "preempt a running request whose priority is lower by more than this (None: never)",
        ge=0,
    )
    # shares of a request's remaining max_new_tokens, as SGLang's init/min_new_token_ratio
    # (which it caps at 1.0): 1 reserves every token a running request may still produce
    new_token_ratio: float = _f(
        0.7, "initial share of remaining new tokens reserved per decode", ge=0, le=1
    )
    min_new_token_ratio: float = _f(0.1, "floor the reserved share decays to", ge=0, le=1)
    new_token_ratio_decay: float = _f(
        0.001, "decay of the reserved share per decode step", ge=0, le=1
    )
    seed: int = _f(0, "seed of the random policy")
    in_batch_prefix_threshold: int = _f(
        32,
        "cache-aware policies admit one of several waiting requests that share this many "
        "uncached tokens per step; the rest follow once it is cached (0: off)",
        ge=0,
    )
    enable_mixed_chunk: bool | None = _f(
        None,
        "run running requests' decodes in the same step as a prefill chunk (default: on for "
        "a CPU, as vLLM's unified batches; off on a GPU, as SGLang)",
    )

    def __post_init__(self) -> None:
        if self.max_wait_ms == math.inf:  # the CLI's way to say "never"; None in the API
            object.__setattr__(self, "max_wait_ms", None)
        check_fields(self)
        if self.min_new_token_ratio > self.new_token_ratio:
            raise ValueError(f"min_new_token_ratio ({self.min_new_token_ratio:g}) must be <= "
                             f"new_token_ratio ({self.new_token_ratio:g})")  # fmt: skip

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This config with the settings left to the device filled in (``device_type``: a
        torch device type, ``cpu`` or an accelerator's). A CPU step costs in proportion to its
        tokens (~4 s per 1,024 on 2 cores), so on a CPU a step holds at most 1,024 new tokens
        and carries the running decodes along, as vLLM-CPU's unified batches do: a wave of
        long prompts no longer holds every first token until all are prefilled, and running
        decodes wait at most one such step; an accelerator keeps SGLang's larger budgets."""
        table = _CPU_SCHED if device_type == "cpu" else _GPU_SCHED
        unset = {k: v for k, v in table.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **unset) if unset else self


_CPU_SCHED = {"max_prefill_tokens": 1024, "chunked_prefill_size": 1024, "enable_mixed_chunk": True}
_GPU_SCHED = {
    "max_prefill_tokens": 16384,
    "chunked_prefill_size": 8192,
    "enable_mixed_chunk": False,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = _f(
        None,
        "HF directory or .gguf file (default: built-in SmolLM2-135M)",
        check=lambda path: lazy_attr("radixserve.modelfiles.locate", "model_path_problem")(path),
    )
    dtype: str = _f(
        "float32",
        "weights dtype (auto: bfloat16 on a GPU or a CPU with AVX512_BF16/AMX, else float32)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    kv_cache_dtype: str = _f(
        "auto",
        "KV cache dtype (auto: the weights')",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    attention_backend: str = _f(
        "auto",
        "attention kernels (auto: cuda-sdpa on a GPU; on a CPU cpu-paged in float32 where its "
        "C++ kernel builds, else cpu-contig; torch-gather: reference)",
        choices=("auto", "cpu-paged", "cpu-contig", "cpu-prefix", "cuda-sdpa", "torch-gather"),
    )
    cpu_kernels: str = _f(
        "auto",
        "radixserve's C++ kernels for float32 on a CPU, built at first use with the machine's "
        "compiler into <weights-cache-dir>/kernels (linear layers, decode attention, norms, rope, "
        "SiLU); off: "
        "PyTorch's (oneDNN linears, cpu-contig attention)",
        choices=("auto", "off"),
    )
    device: str = _f("cpu", "torch device (cpu, cuda, cuda:0, ...)", check=device_problem)
    context_length: int | None = _f(None, "longest sequence (default: the model's)", ge=1)
    weights_cache_dir: str = _f(
        "~/.cache/radixserve",
        "where a .gguf model is converted (dequantized) once, keyed by its content, and reused",
        check=dir_problem,
    )
    sampling_seed: int = _f(
        0, "seed of the sampler for requests that carry no seed of their own", ge=0, lt=2**64
    )
    cuda_graph_max_bs: int = _f(
        256,
        "on a CUDA device, the largest decode batch run as a CUDA graph (captured per "
        "batch-size and context-width bucket the first time one is needed); larger batches, "
        "and steps with a prefill, run kernel by kernel",
        ge=1,
    )
    disable_cuda_graph: bool = _f(False, "run every decode step kernel by kernel on a CUDA device")
    tp_size: int = _f(
        1,
        "tensor parallelism: split the model over this many processes (one per device on "
        "CUDA, NCCL; CPU processes share the cores, gloo): heads and MLP columns by rank",
        ge=1,
    )
    num_threads: int = _f(
        0,
        "torch CPU threads of the model (0: OMP_NUM_THREADS if set, else one per core; on a "
        "machine other processes keep busy, fewer threads avoid stalls where they share cores)",
        ge=0,
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.cpu_kernels == "off" and self.attention_backend == "cpu-paged":
            raise ValueError(
                "--attention-backend cpu-paged runs radixserve's CPU kernels, which "
                "--cpu-kernels off turns off: choose one"
            )


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Prefill/decode disaggregation (SGLang's flags and names): which half of the work this
    engine does, and how the prompt's KV pages move from a prefill engine to a decode engine."""

    disaggregation_mode: str = _f(
        "null",
        "null: prefill and decode here (as without the flag); prefill: compute prompts and send "
        "their KV pages to the decode engine that registered the request's bootstrap_room; "
        "decode: receive those pages, then generate (requests must carry bootstrap_room)",
        choices=("null", "prefill", "decode"),
    )
    disaggregation_bootstrap_port: int = _f(
        8998, "prefill: port of the bootstrap server decode engines ask (/route)", ge=1, le=65535
    )
    disaggregation_transfer_backend: str = _f(
        "mooncake",
        "how pages move: Mooncake's transfer engine (the mooncake extra; TCP, or RDMA with "
        "--disaggregation-ib-device). SGLang's nixl and fake backends are not offered: NIXL "
        "needs UCX and a GPU, and fake moves no bytes, so its decode output would be wrong",
        choices=("mooncake",),
    )
    disaggregation_host: str = _f(
        "127.0.0.1",
        "address the peer engines reach this engine's scheduler and transfer engine at (the "
        "machine's address when prefill and decode run on different machines)",
    )
    disaggregation_ib_device: str | None = _f(
        None, "RDMA device(s) for Mooncake's transfer engine (default: TCP)"
    )
    disaggregation_waiting_timeout: float = _f(
        300.0,
        "seconds a prefill waits for its decode engine to register the room, and a decode "
        "waits for its pages, before the request ends with an error",
        gt=0,
    )

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def enabled(self) -> bool:
        return self.disaggregation_mode != "null"


TRACE_EXTRA = (
    "--enable-trace needs the OpenTelemetry SDK and its OTLP exporter: "
    "pip install 'radixserve[trace]'"
)


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """OpenTelemetry traces (SGLang's and smg's flag names), shared by `route` and `serve`:
    spans go to an OTLP/HTTP collector; a W3C traceparent links router and engine spans."""

    enable_trace: bool = _f(False, "export OpenTelemetry traces (needs radixserve[trace])")
    otlp_traces_endpoint: str = _f(
        "localhost:4318",
        "OTLP/HTTP collector: HOST:PORT (spans posted to /v1/traces) or a full http(s):// URL",
    )

    def __post_init__(self) -> None:
        if not self.enable_trace:
            if self.otlp_traces_endpoint != "localhost:4318":  # refused, not ignored
                raise ValueError("--otlp-traces-endpoint needs --enable-trace")
            return
        url = self.traces_url  # a malformed endpoint is one line now
        if not re.fullmatch(r"https?://(\[[0-9A-Fa-f:]+\]|[^/\s:\[\]]+)(:\d{1,5})?(/\S*)?", url):
            raise ValueError(f"--otlp-traces-endpoint {self.otlp_traces_endpoint!r}: expected "
                             "HOST:PORT or http(s)://HOST:PORT/PATH")  # fmt: skip
        import importlib

        for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
            try:  # imported, not looked up: a broken install fails here, not at the first span
                importlib.import_module(module)
            except ImportError:
                raise ValueError(TRACE_EXTRA) from None

    @property
    def traces_url(self) -> str:
        """Where spans are posted (OTLP/HTTP's /v1/traces under HOST:PORT)."""
        ep = self.otlp_traces_endpoint.strip()
        return ep if "://" in ep else f"http://{ep}/v1/traces"
