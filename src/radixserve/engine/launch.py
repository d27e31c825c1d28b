"""Starting an engine: its config, its two child processes (scheduler + runner, detokenizer),
and the readiness handshake. The HTTP server and the in-process ``Engine`` both use this."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import (
    CacheConfig,
    DisaggConfig,
    ModelConfig,
    SchedulerConfig,
    TraceConfig,
)
from radixserve.engine.kv_events import KVEventsConfig
from radixserve.engine.procutil import Endpoints
from radixserve.engine.tokenizer_spec import TokenizerSpec
from radixserve.modelfiles.sim_tokenizer import SIM_VOCAB_SIZE

START_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)
    sim: str | None = None  # a cost-model preset: simulated runner, real time
    sim_vocab_size: int = SIM_VOCAB_SIZE  # the simulated tokenizer's vocabulary
    kv_events: KVEventsConfig | None = None  # publish KV-cache events (engine/kv_events.py)
    # --sim only: write prompts' pages to a KV store as placeholders (engine/sim_store.py)
    sim_kv_store: dict[str, Any] | None = None
    disagg: DisaggConfig = field(default_factory=DisaggConfig)  # prefill/decode apart
    trace: TraceConfig = field(default_factory=TraceConfig)  # OpenTelemetry spans (--enable-trace)

    def __post_init__(self) -> None:
        if self.disagg.enabled and self.sim is not None:
            raise ValueError("--disaggregation-mode needs a real model: a simulated engine has "
                             "no KV pages to send")  # fmt: skip
        # the scheduler's device-dependent defaults, for the device the steps run on (a
        # simulated engine models an accelerator)
        device = "cuda" if self.sim is not None else self.model.device.split(":")[0]
        object.__setattr__(self, "sched", self.sched.for_device(device))
        if self.kv_events is not None:
            self.kv_events.check_page_size(self.cache.page_size)
        if self.sim_kv_store is not None:
            from radixserve.engine.sim_store import parse_sim_store

            if self.sim is None:
                raise ValueError("--sim-kv-store needs --sim (a real engine writes real pages)")
            object.__setattr__(self, "sim_kv_store", parse_sim_store(self.sim_kv_store))
        self._check_tp()
        if self.cache.hicache_storage_backend is not None:
            if self.sim is not None:
                raise ValueError("--hicache-storage-backend needs a real model (a simulated "
                                 "engine has no KV bytes; see --sim-kv-store)")  # fmt: skip
            self.storage_settings()  # a bad extra-config is one line before any process starts

    def _check_tp(self) -> None:
        """What --tp-size > 1 does not run with yet: one line before any process starts."""
        if self.model.tp_size == 1:
            return
        if self.sim is not None:
            raise ValueError("--tp-size needs a real model (a simulated engine has no weights)")
        if self.disagg.enabled:
            raise ValueError("--tp-size > 1 with --disaggregation-mode is not supported")

    def storage_settings(self) -> Any:
        """The storage tier's settings (engine.storage_settings.StorageSettings), or None."""
        c = self.cache
        if c.hicache_storage_backend is None:
            return None
        from radixserve.engine.storage_settings import StorageSettings

        s = StorageSettings.parse(c.hicache_storage_backend,
                                  c.hicache_storage_backend_extra_config,
                                  c.hicache_storage_prefetch_policy)  # fmt: skip
        if s.chunk_size % c.page_size:
            raise ValueError(f"--hicache-storage-backend-extra-config chunk_size {s.chunk_size} "
                             f"must be a multiple of --page-size {c.page_size}")  # fmt: skip
        return s

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments named like the fields of the three configs."""
        parts: dict[str, Any] = {}
        for name, part_cls in (("model", ModelConfig), ("cache", CacheConfig),
                               ("sched", SchedulerConfig), ("disagg", DisaggConfig)):  # fmt: skip
            names = {f.name for f in dataclasses.fields(part_cls)}
            parts[name] = part_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        own = {k: kwargs.pop(k) for k in ("sim", "sim_vocab_size", "sim_kv_store") if k in kwargs}
        events = kwargs.pop("kv_events_config", None)
        if kwargs:
            raise TypeError(f"unknown engine options: {', '.join(sorted(kwargs))}")
        kv_events = KVEventsConfig.from_json(events) if events is not None else None
        return cls(kv_events=kv_events, **own, **parts)

    def tokenizer_spec(self) -> TokenizerSpec:
        if self.sim is not None:
            return TokenizerSpec("sim", None, self.model.context_length, self.sim_vocab_size)
        from radixserve.modelfiles.locate import model_name, resolve_model_dir

        model_dir = str(resolve_model_dir(self.model))
        return TokenizerSpec(
            "hf", model_dir, self.model.context_length, name=model_name(self.model)
        )

    def build_worker(self) -> tuple[Any, Any, dict[str, Any]]:
        """Runner, Scheduler and model facts (called inside the scheduler process)."""
        from radixserve.sched.scheduler import Scheduler

        runner, cache, info = self._sim_runner() if self.sim else self._torch_runner()
        pool = getattr(runner, "kv", None)  # a simulated runner has no KV bytes
        host_tokens = cache.host_tokens(pool.nbytes // pool.num_slots if pool else None)
        scheduler = Scheduler(
            self.sched, cache, eos_token_ids=info["eos_token_ids"],
            context_length=info["context_length"], host_tokens=host_tokens,
        )  # fmt: skip
        return runner, scheduler, {**info, "max_total_tokens": cache.max_total_tokens,
                                   "host_tier_tokens": host_tokens}  # fmt: skip

    def _sim_runner(self) -> tuple[Any, CacheConfig, dict[str, Any]]:
        from radixserve.sim.costmodel import get_cost_model
        from radixserve.sim.runner import SimRunner

        tok = self.tokenizer_spec().load()
        cost = get_cost_model(self.sim)  # type: ignore[arg-type]
        cache = self.cache
        if cache.max_total_tokens == CacheConfig().max_total_tokens:  # not set: the GPU's
            cache = dataclasses.replace(cache, max_total_tokens=cost.kv_capacity_tokens)
        runner = SimRunner(cost, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_ids[0])
        info = {"model": f"sim-{self.sim}", "context_length": tok.context_length,
                "eos_token_ids": tok.eos_token_ids, "vocab_size": tok.vocab_size,
                # what it reports to a kv_aware router: its cost model's, for the tiers it has
                **self._sim_ratios(cost)}  # fmt: skip
        return runner, cache, info

    def _sim_ratios(self, cost: Any) -> dict[str, float | None]:
        """The cost model's load-to-prefill ratios: the host tier's with
        --enable-hierarchical-cache, the store's with --sim-kv-store (None without)."""
        from radixserve.engine.load_meter import ratio_fields

        host = cost.host_load_to_prefill_ratio() if self.cache.enable_hierarchical_cache else None
        store = cost.load_to_prefill_ratio() if self.sim_kv_store is not None else None
        return ratio_fields(host, store)

    def _torch_runner(self) -> tuple[Any, CacheConfig, dict[str, Any]]:
        from radixserve.model.load_ratio import measure_load_sample, sample_ratio
        from radixserve.model.runner import TorchRunner

        if self.model.tp_size > 1:
            from radixserve.engine.tp_ranks import TPRunner

            runner = TPRunner(self.model, self.cache.max_total_tokens)
        else:
            runner = TorchRunner(self.model, self.cache.max_total_tokens)
        # what a kv_aware router charges for KV this engine loads instead of computing: a
        # prefill and a host -> device copy timed once here (only where there is a lower tier
        # to load from: it costs two 1,024-token prefills), then running means while it serves
        sample = measure_load_sample(runner) if self.cache.enable_hierarchical_cache else None
        info = {"model": runner.info.name, "context_length": runner.info.context_length,
                "eos_token_ids": runner.info.eos_token_ids,
                "vocab_size": runner.info.vocab_size,
                # what --dtype auto / --kv-cache-dtype / --attention-backend resolved to
                "dtype": str(runner.dtype).removeprefix("torch."),
                "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
                "attention_backend": runner.backend.name,
                "num_threads": _torch_threads(),
                "tp_size": self.model.tp_size,
                "tp_rank_pids": getattr(runner, "rank_pids", []),
                "kv_load_sample": sample, "kv_load_to_prefill_ratio": sample_ratio(sample)}  # fmt: skip
        return runner, self.cache, info


class EngineStartError(RuntimeError):
    pass


@dataclass
class EngineProcesses:
    """The running child processes of one engine, and how to reach them."""

    config: EngineConfig
    endpoints: Endpoints
    procs: list[mp.process.BaseProcess]
    tokenizer: Any
    info: dict[str, Any]

    def why_dead(self) -> str | None:
        for p in self.procs:
            if not p.is_alive():
                note = self.endpoints.death_note()  # what the process said as it went
                return f"{p.name} exited with code {p.exitcode}" + (f" ({note})" if note else "")
        return None

    def shutdown(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.endpoints.cleanup()


def launch(config: EngineConfig) -> EngineProcesses:
    """Start the scheduler and detokenizer processes and wait until the model is loaded."""
    from radixserve.engine.detokenizer import run_detokenizer
    from radixserve.engine.scheduler_proc import run_scheduler

    if config.sim is None:
        _check_engine_extra()
    ctx = mp.get_context("spawn")
    endpoints, spec = Endpoints.new(), config.tokenizer_spec()
    parent, child = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=run_scheduler, args=(config, endpoints, child, os.getpid()),
                    name="radixserve-scheduler", daemon=True),
        ctx.Process(target=run_detokenizer, args=(spec, endpoints, os.getpid()),
                    name="radixserve-detokenizer", daemon=True),
    ]  # fmt: skip
    _start_all(procs)
    engine = EngineProcesses(config, endpoints, procs, None, {})
    try:
        engine.tokenizer = spec.load()
        status, payload = _wait_ready(engine, parent)
    except BaseException:  # interrupted while the model loads: stop the children, remove sockets
        engine.shutdown()
        raise
    if status != "ready":
        engine.shutdown()
        raise EngineStartError(f"the scheduler process failed to start: {payload}")
    engine.info = payload
    return engine


def _torch_threads() -> int:
    """The torch CPU threads this (the scheduler) process computes with."""
    import torch

    return torch.get_num_threads()


ENGINE_EXTRA = ("torch", "tokenizers", "safetensors", "gguf")


def _check_engine_extra() -> None:
    """A real model needs the ``engine`` extra; say how to install it rather than fail deep in a
    child process."""
    import importlib.util

    missing = [m for m in ENGINE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise EngineStartError(
            f"running a model needs {', '.join(missing)} (the 'engine' extra); install it with: "
            'pip install torch==2.13.0 && pip install "radixserve[engine]" '
            "(or serve a simulated model with --sim PRESET, which needs neither)"
        )


def _start_all(procs: list[mp.process.BaseProcess]) -> None:
    """Start the children with SIGINT and SIGTERM held, so that a signal cannot land while a
    child is half started; it is delivered (and handled by the caller) once all have started."""
    held = {signal.SIGINT, signal.SIGTERM}
    can_hold = threading.current_thread() is threading.main_thread() and hasattr(
        signal, "pthread_sigmask"
    )
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held) if can_hold else None
    try:
        with _main_hidden():
            for p in procs:
                p.start()
    except OSError as e:  # no fork/exec, no semaphores, a process limit: say so in one line
        for p in procs:
            if p.pid is not None:
                p.kill()
        raise EngineStartError(f"radixserve cannot start its engine's child processes on this "
                               f"platform: {e}") from e  # fmt: skip
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def _main_hidden() -> Iterator[None]:
    """The children run radixserve's code only, so spawn must not re-run the caller's
    ``__main__`` in them: code from stdin has no file to re-run, a notebook has none either,
    and a script without an ``if __name__ == "__main__"`` guard would start engines forever."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _wait_ready(engine: EngineProcesses, conn: Any) -> tuple[str, Any]:
    waited = 0.0
    while not conn.poll(0.5):
        waited += 0.5
        dead = engine.why_dead()
        if dead or waited > START_TIMEOUT_S:  # the caller shuts the engine down
            raise EngineStartError(f"the scheduler process did not start: {dead or 'timeout'}")
    return conn.recv()
