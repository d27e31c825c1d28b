"""Frozen dataclass configs for every component; CLI flags are generated from their fields.

Each field's ``metadata["help"]`` is its help text; ``add_dataclass_args`` turns a dataclass
into an argparse group and ``from_args`` builds the dataclass back from parsed arguments.
Values derived at run time live in the components' own runtime objects, never here.

A field's bounds live in its metadata (``ge``, ``gt``, ``le``, ``lt``; ``also``: values allowed
besides, such as -1 for "off"; ``check``: a function naming what is wrong with a value, run on
the command line only, where it may look at files). ``check_fields`` applies the bounds in
``__post_init__``; the flags apply them while parsing, and ``CliParser`` builds every config
right after parsing, so a bad value is one line and exit status 2 before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


def bound_problem(value: Any, meta: typing.Mapping[str, Any]) -> str | None:
    """What is wrong with ``value`` under the bounds in ``meta``, or None (None is no value)."""
    if value is None or isinstance(value, bool) or value in meta.get("also", ()):
        return None
    if isinstance(value, float) and math.isnan(value):
        return "must be a number (got nan)"
    for key, op, holds in _BOUNDS:
        if key in meta and not holds(value, meta[key]):
            also = "".join(f" or {a}" for a in meta.get("also", ()))
            shown = f"{value:g}" if isinstance(value, float) else repr(value)
            return f"must be {op} {meta[key]}{also} (got {shown})"
    return None


_BOUNDS = (("ge", ">=", operator.ge), ("gt", ">", operator.gt),
           ("le", "<=", operator.le), ("lt", "<", operator.lt))  # fmt: skip


def check_fields(obj: Any) -> None:
    """Refuse a field outside its metadata's bounds: ValueError naming the field."""
    for f in dataclasses.fields(obj):
        if problem := bound_problem(getattr(obj, f.name), f.metadata):
            raise ValueError(f"{f.name} {problem}")


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
        check=lambda path: _lazy("radixserve.modelfiles.locate", "model_path_problem")(path),
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
    device: str = _f("cpu", "torch device (cpu, cuda, cuda:0, ...)", check=lambda d: _device(d))
    context_length: int | None = _f(None, "longest sequence (default: the model's)", ge=1)
    weights_cache_dir: str = _f(
        "~/.cache/radixserve",
        "where a .gguf model is converted (dequantized) once, keyed by its content, and reused",
        check=lambda d: _dir_problem(d),
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


def choices_of(choices: tuple[str, ...] | str) -> tuple[str, ...]:
    """A field's choices: listed, or "module:NAME" of a registry read when the flags are made
    (registries that import this module cannot be imported by it at load time)."""
    if isinstance(choices, str):
        return tuple(_lazy(*choices.split(":")))
    return choices


def _lazy(module: str, name: str) -> Any:
    import importlib

    return getattr(importlib.import_module(module), name)


def _device(text: str) -> str | None:
    """What keeps ``text`` from naming a usable torch device (torch imported only if not cpu)."""
    if text == "cpu":
        return None
    try:
        import torch
    except ImportError:
        return f"{text!r} needs torch (pip install 'radixserve[engine]')"

    try:
        device = torch.device(text)
    except RuntimeError:
        return f"is not a torch device (got {text!r}; e.g. cpu, cuda, cuda:1)"
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", lambda: False)()
    if not available:
        return f"has no usable {device.type} device here (torch {torch.__version__}; got {text!r})"
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        return f"names {device.type} device {device.index}, but only {count} are here"
    return None


def _dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be a directory this process writes in (it may be made later)."""
    p = os.path.expanduser(path)
    while not os.path.exists(p):  # the closest existing ancestor decides
        p = os.path.dirname(p.rstrip("/")) or "."
    if not os.path.isdir(p):
        return f"{p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"cannot write in {p}"
    return None


def writable_file(path: str) -> str:
    """argparse ``type`` of an output file: refused at once if it cannot be written later (the
    file is opened for appending, and removed again if this made it)."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"no directory {parent} to write {path} in")
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {e.strerror}") from None
    if not existed:
        os.remove(path)
    return path


def bounded(tp: Callable[[str], Any], **meta: Any) -> Callable[[str], Any]:
    """argparse ``type``: ``tp`` whose value must keep ``meta``'s bounds (and ``check``)."""

    def convert(text: str) -> Any:
        value = tp(text)  # ValueError: argparse says "invalid int value: 'x'"
        problem = bound_problem(value, meta) or (meta["check"](value) if "check" in meta else None)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = getattr(tp, "__name__", "value")
    return convert


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, title: str, check: bool = True, group: Any = None
) -> None:
    """Add one ``--flag-name`` per field of ``cls`` to a new argument group; each value keeps its
    field's bounds. A field whose type is itself a config dataclass (settings shared by several
    commands) adds its own fields' flags to the same group, under their own names. With
    ``check`` (and a ``CliParser``), ``cls`` is built right after parsing, so its
    ``__post_init__`` refuses bad combinations before the command runs."""
    group = parser.add_argument_group(title) if group is None else group
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            add_dataclass_args(parser, tp, title, False, group)  # type: ignore[arg-type]
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata.get("help")}
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if "choices" in f.metadata:
            kw["choices"] = choices_of(f.metadata["choices"])
        if f.metadata.get("repeat"):  # --prefill URL [PORT] --prefill URL2: one list each
            nargs = "+" if f.metadata["repeat"] is True else f.metadata["repeat"]
            kw.update(action="append", nargs=nargs, default=None, metavar=f.metadata.get("metavar"))
            group.add_argument(flag, **kw)
            continue
        if typing.get_origin(tp) is tuple:  # a list flag, as in sglang-router: --worker-urls A B C
            tp = typing.get_args(tp)[0]
            kw.update(nargs="*", metavar=f.metadata.get("metavar"))
        group.add_argument(flag, type=bounded(tp, **f.metadata), **kw)
    if check:
        add_check(parser, lambda args: from_args(cls, args))


def add_check(
    parser: argparse.ArgumentParser, check: Callable[[argparse.Namespace], object]
) -> None:
    """Run ``check`` on the parsed arguments before the command (a CliParser's only)."""
    if isinstance(parser, CliParser):
        parser.checks.append(check)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from the parsed arguments that share its field names (and its nested
    configs' field names: see add_dataclass_args)."""
    return from_flags(cls, vars(args))


def flag_names(cls: type) -> set[str]:
    """The flag names (field names) of ``cls``, its nested configs' included."""
    hints = typing.get_type_hints(cls)
    names: set[str] = set()
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        names |= flag_names(tp) if dataclasses.is_dataclass(tp) else {f.name}
    return names


def from_flags(cls: type[T], values: Mapping[str, Any]) -> T:
    """Build ``cls`` from flat flag values, as the command line gives them: a nested config is
    built from the values named as its fields. Names ``cls`` has no flag for are left out."""
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            kw[f.name] = from_flags(tp, values)  # type: ignore[arg-type]
        elif f.name in values:
            kw[f.name] = values[f.name]
    return cls(**kw)


def with_flags(cls: type[T], **values: Any) -> T:
    """``cls`` built from flag values given by name (``with_flags(RouterConfig, port=0,
    cache_threshold=0.7)``); a name that is no flag of ``cls`` is a TypeError."""
    unknown = sorted(set(values) - flag_names(cls))
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(unknown)}")
    return from_flags(cls, values)


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit status 2: ``radixserve serve: error:
    --max-wait-ms must be >= 0 (got -5); see radixserve serve --help``, never the usage. Its
    ``checks`` run on the parsed arguments (a ValueError is such an error), before the command;
    subparsers made from it are CliParsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list[Callable[[argparse.Namespace], object]] = []

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        for check in self.checks:
            try:
                check(parsed)
            except ValueError as e:
                self.error(str(e))
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_flag_first(message)}; see {self.prog} --help\n")


def _flag_first(message: str) -> str:
    """argparse's "argument --x: must be ..." as "--x must be ..."; one line."""
    message = " ".join(message.split())
    m = re.fullmatch(r"argument (\S+): (.*)", message)
    if m is None:
        return message
    flag, what = m.groups()
    return (
        f"{flag} {what}"
        if what.startswith(("must", "has ", "names ", "is "))
        else f"{flag}: {what}"
    )
