"""Where one engine step's time goes, on the built-in SmolLM2-135M-Instruct.

Runs the scheduler process's step (``Worker.step``: scheduler -> runner -> scheduler ->
ZeroMQ) in this process, with the real scheduler, runner, sockets and detokenizer, and times
each part by wrapping it: the model forward split into norms, QKV projection, rope, KV write,
attention (and the KV gather inside it), O projection, MLP; the final norm + LM head, the
sampler, the scheduler, IPC (pickle + ZeroMQ send and receive) and the detokenizer.

For each batch size B: B requests share a 384-token cached prefix (as after the prefix cache
warms; ``--prefix-groups G`` spreads them over G distinct prefixes, ``--prefix-len`` sets its
length) and add 32 distinct prompt tokens (``--suffix-len``). The prefill step computes the
B x 32 new tokens on the cached context; then decode steps (B rows each, contexts ~420 tokens)
are timed and the median kept. Milliseconds per step; wrapper overhead is ~1 us per call. With
radixserve's CPU kernels (float32 default) the K/V store happens inside the fused rope call, so
"kv write" reads 0 and "rope" holds both.

    python benchmarks/engine_profile.py [--batches 1 8 32] [--decode-steps 5] [--dtype float32]
        [--attention-backend NAME]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from _omp import OMP  # first: the engine's OpenMP wait policy, set before torch loads

# isort: split
import torch
import torch.nn.functional as F
import zmq

from _machine import machine_line
from radixserve.config import CacheConfig, ModelConfig, SchedulerConfig
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.messages import GenerateReq, OpenStream, StopReq, TokenBatch
from radixserve.engine.scheduler_proc import Worker
from radixserve.model import llama, rope
from radixserve.model.runner import TorchRunner
from radixserve.sched.request import SamplingParams
from radixserve.sched.scheduler import Scheduler

ROWS = [
    "norms", "qkv proj", "rope", "kv write", "attention gather", "attention compute",
    "o proj", "mlp", "layer other", "lm head", "runner other", "sampler", "scheduler",
    "ipc", "detokenizer",
]  # fmt: skip


class Timers:
    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.stack: list[str] = []

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = name(*args, **kwargs) if callable(name) else name
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[label] += time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        out, self.acc = dict(self.acc), defaultdict(float)
        return out


def instrument(t: Timers, run: TorchRunner, worker: Worker) -> None:
    """Wrap the hot calls with timers (instance or module attributes, nothing else changes)."""
    f_ns = SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("_")})
    f_ns.silu = t.wrap("mlp", F.silu)
    llama.F = f_ns
    run.model._rms_norm = t.wrap("norms", run.model._rms_norm)
    run.model._lm_head = t.wrap("lm head", run.model._lm_head)
    llama.Linear.__call__ = t.wrap(lambda self, x: self.name, _ORIG["Linear"])
    llama.rope = SimpleNamespace(apply_rope=t.wrap("rope", rope.apply_rope), cos_sin=rope.cos_sin)
    run.kv.write = t.wrap("kv write", run.kv.write)
    run.kv.gather = t.wrap("attention gather", run.kv.gather)
    run.model.backend.attend = t.wrap("attention", run.model.backend.attend)
    run.model._layer_forward = t.wrap("layers", run.model._layer_forward)
    run.model._layer_forward_fused = t.wrap("layers", run.model._layer_forward_fused)
    k = run.model.kernels
    if k is not None:  # our kernels: the fused small ops (rope_and_cache also writes the KV)
        _WRAPPED_KERNELS.append(k)
        object.__setattr__(k, "rms_norm", t.wrap("norms", k.rms_norm))
        object.__setattr__(k, "silu_mul", t.wrap("mlp", k.silu_mul))
        object.__setattr__(k, "rope_and_cache", t.wrap("rope", k.rope_and_cache))
    run.sampler.sample = t.wrap("sampler", run.sampler.sample)
    run.run = t.wrap("runner", run.run)
    worker.scheduler.step = t.wrap("scheduler", worker.scheduler.step)
    worker.scheduler.on_output = t.wrap("scheduler", worker.scheduler.on_output)
    worker.push.send_pyobj = t.wrap("ipc", worker.push.send_pyobj)


def rows_of(raw: dict[str, float]) -> dict[str, float]:
    """Exclusive times per ROWS from the (nested) wrapped totals."""
    g = raw.get
    out = {k: g(k, 0.0) for k in ("norms", "qkv proj", "rope", "kv write", "o proj", "mlp")}
    out["attention gather"] = g("attention gather", 0.0)
    out["attention compute"] = g("attention", 0.0) - out["attention gather"]
    inner = sum(out.values())
    out["layer other"] = g("layers", 0.0) - inner
    out["lm head"] = g("lm head", 0.0)
    out["sampler"] = g("sampler", 0.0)
    out["runner other"] = g("runner", 0.0) - g("layers", 0.0) - out["lm head"] - out["sampler"]
    out["scheduler"] = g("scheduler", 0.0)
    out["ipc"] = g("ipc", 0.0) + g("ipc recv", 0.0)
    out["detokenizer"] = g("detokenizer", 0.0)
    out["total"] = g("runner", 0.0) + out["scheduler"] + out["ipc"] + out["detokenizer"]
    return out


def profile_batch(b: int, args: argparse.Namespace, model: ModelConfig) -> dict[str, dict]:
    run = TorchRunner(model, num_slots=32768)
    sched = Scheduler(SchedulerConfig(), CacheConfig(max_total_tokens=32768),
                      eos_token_ids=run.info.eos_token_ids,
                      context_length=run.info.context_length)  # fmt: skip
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    detok_in = ctx.socket(zmq.PULL)
    pull.bind("inproc://sched")
    detok_in.bind("inproc://detok")
    push.connect("inproc://detok")
    worker = Worker(sched, run, pull, push, realtime=False)
    tok = run.info.tokenizer
    detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=True))
    t = Timers()

    def drain_detok() -> None:
        t0 = time.perf_counter()
        while detok_in.poll(0):
            msg = detok_in.recv_pyobj()
            t1 = time.perf_counter()
            t.acc["ipc recv"] += t1 - t0
            if isinstance(msg, OpenStream):
                detok.open(msg.rid, msg.stop, msg.skip_special_tokens, msg.no_stop_trim,
                           msg.min_new_tokens)  # fmt: skip
            elif isinstance(msg, TokenBatch):
                for out in msg.outputs:
                    detok.feed(out)
            t0 = time.perf_counter()
            t.acc["detokenizer"] += t0 - t1

    sampling = SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True)
    vocab = run.info.vocab_size
    groups = max(1, min(args.prefix_groups, b))
    prefixes = [[(7 * i + 11 + 997 * g) % vocab for i in range(args.prefix_len)]
                for g in range(groups)]  # fmt: skip

    def add(rid: str, ids: list[int]) -> None:
        worker.handle(GenerateReq(rid, ids, sampling))

    for g, prefix in enumerate(prefixes):  # caches each group's prefix
        add(f"warm{g}", prefix + [5] * 4)
        while sched.get(f"warm{g}") is not None and sched.get(f"warm{g}").num_generated < 2:
            worker.step()
        worker.handle(_stop(f"warm{g}"))
        drain_detok()
    instrument(t, run, worker)
    for i in range(b):
        suffix = [(101 * i + 13 * j + 3) % vocab for j in range(args.suffix_len)]
        add(f"r{i}", prefixes[i % groups] + suffix)
    drain_detok()
    t.take()
    worker.step()
    drain_detok()
    prefill = rows_of(t.take())
    decodes = []
    for _ in range(args.decode_steps):
        worker.step()
        drain_detok()
        decodes.append(rows_of(t.take()))
    decode = {k: statistics.median(d[k] for d in decodes) for k in decodes[0]}
    for s in (pull, push, detok_in):
        s.close(0)
    ctx.term()
    _restore()
    return {"prefill": prefill, "decode": decode}


def _stop(rid: str) -> StopReq:
    return StopReq(rid)


_ORIG = {"F": llama.F, "rope": llama.rope, "Linear": llama.Linear.__call__}


def _restore() -> None:
    llama.F, llama.rope = _ORIG["F"], _ORIG["rope"]
    llama.Linear.__call__ = _ORIG["Linear"]
    for k in _WRAPPED_KERNELS:  # the loaded kernels are shared by every runner in the process
        for name in ("rms_norm", "silu_mul", "rope_and_cache"):
            if name in vars(k):
                object.__delattr__(k, name)
    _WRAPPED_KERNELS.clear()


_WRAPPED_KERNELS: list = []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--decode-steps", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--prefix-len", type=int, default=384, help="cached prefix tokens per request")
    p.add_argument("--suffix-len", type=int, default=32, help="new prompt tokens per request")
    p.add_argument(
        "--prefix-groups",
        type=int,
        default=1,
        help="distinct cached prefixes the B requests spread over (at most B)",
    )
    args = p.parse_args()
    kw: dict[str, Any] = {"dtype": args.dtype, "num_threads": args.num_threads}
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    model = ModelConfig(**kw)
    print(machine_line())
    results = {b: profile_batch(b, args, model) for b in args.batches}
    print(f"SmolLM2-135M, dtype {args.dtype}, attention {args.attention_backend or 'auto'}, "
          f"{torch.get_num_threads()} torch threads (OpenMP {OMP}); prefix {args.prefix_len} cached (in "
          f"{args.prefix_groups} group(s)) + {args.suffix_len} new tokens per request; ms per "
          f"step (decode: median of {args.decode_steps})")  # fmt: skip
    heads = [f"{kind} B={b}" for kind in ("prefill", "decode") for b in args.batches]
    print("| part | " + " | ".join(heads) + " |")
    print("|---" * (len(heads) + 1) + "|")
    for row in ROWS + ["total"]:
        cells = [results[b][kind][row] * 1e3 for kind in ("prefill", "decode")
                 for b in args.batches]  # fmt: skip
        print(f"| {row} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
