"""Starting Mooncake Store's own processes (the master and the store process that holds the
shared segment) with every port chosen explicitly, and knowing when they are ready."""

# Why every port is set: mooncake_master listens on 50051 (RPC), 9003 (metrics/admin HTTP) and
# 8080 (HTTP metadata) unless told otherwise, on all interfaces; the transfer engine of every
# client (ours and the store process) binds random ports in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT
# (default 15000-17000) and the store client one in MC_STORE_CLIENT_MIN_PORT..MAX (default
# 12300-14300). Mooncake refuses a range that touches Linux's ephemeral ports (32768-60999) and
# silently falls back to its default, so the windows here are always taken below 32768.
# P2PHANDSHAKE instead of the HTTP metadata server: no extra server, nothing bound to 0.0.0.0
# beyond the transfer engine's own sockets.

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

WINDOW_LOW, WINDOW_HIGH = 20_000, 32_000  # below the kernel's ephemeral range, as Mooncake wants
READY_TIMEOUT_S = 20.0


class MooncakeNotInstalled(RuntimeError):
    """The mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed."""


def binary(name: str) -> str:
    """Path of one of the wheel's executables (`mooncake_master`, `mooncake_client`)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / name
            if path.is_file():
                return str(path)
    found = shutil.which(name)
    if found is None:
        raise MooncakeNotInstalled(
            f"{name} not found: pip install 'radixserve[mooncake]' "
            "(mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def port_window(size: int = 64, rng: random.Random | None = None) -> tuple[int, int]:
    """A window of ports below the ephemeral range whose ends and middle are free now (Mooncake
    retries a port taken later, so a spot check is enough)."""
    rng = rng or random.Random()
    for _ in range(200):
        low = rng.randrange(WINDOW_LOW, WINDOW_HIGH - size)
        if all(_bindable(p) for p in (low, low + size // 2, low + size - 1)):
            return low, low + size - 1
    raise RuntimeError(f"no free window of {size} ports in {WINDOW_LOW}-{WINDOW_HIGH}")


def port_env(te_ports: tuple[int, int], client_ports: tuple[int, int]) -> dict[str, str]:
    """The MC_* variables that pin a Mooncake client's ports (transfer engine, store client)."""
    return {
        "MC_MIN_RPC_PORT": str(te_ports[0]),
        "MC_MAX_RPC_PORT": str(te_ports[1]),
        "MC_STORE_CLIENT_MIN_PORT": str(client_ports[0]),
        "MC_STORE_CLIENT_MAX_PORT": str(client_ports[1]),
    }


@dataclass(frozen=True, slots=True)
class MasterPorts:
    rpc: int
    metrics: int
    http_metadata: int  # unused with P2PHANDSHAKE, but never left at 8080

    @classmethod
    def free(cls) -> MasterPorts:
        return cls(free_port(), free_port(), free_port())


def master_command(ports: MasterPorts, client_ttl_s: int = 10) -> list[str]:
    return [
        binary("mooncake_master"),
        "--rpc_address=127.0.0.1",
        f"--rpc_port={ports.rpc}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={ports.metrics}",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={ports.http_metadata}",
        f"--client_ttl={client_ttl_s}",
        "--logtostderr",
    ]


def store_command(
    master_rpc: str, host: str, client_port: int, service_port: int, segment_bytes: int
) -> list[str]:
    """`mooncake_client`: a process whose only job is to mount `segment_bytes` of memory into the
    pool; engines mount none, so every object they put lives here and outlives them."""
    return [
        binary("mooncake_client"),
        f"--host={host}:{client_port}",
        f"--port={service_port}",
        f"--master_server_address={master_rpc}",
        "--metadata_server=P2PHANDSHAKE",
        f"--global_segment_size={segment_bytes}",
        "--local_buffer_size=0",
        "--protocol=tcp",
        "--logtostderr",
    ]


def admin_get(metrics_addr: str, path: str, timeout_s: float = 2.0) -> bytes:
    with urllib.request.urlopen(f"http://{metrics_addr}{path}", timeout=timeout_s) as resp:
        return resp.read()


def master_healthy(metrics_addr: str) -> bool:
    try:
        return bool(json.loads(admin_get(metrics_addr, "/health", 0.5)).get("service_ready"))
    except (OSError, ValueError):
        return False


def segments(metrics_addr: str) -> list[dict]:
    """The master's mounted segments (/get_segments_detail): name, te_endpoint, size_bytes."""
    return json.loads(admin_get(metrics_addr, "/get_segments_detail")).get("segments") or []


def wait_until(check, what: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s")
        time.sleep(0.05)


def segment_of(metrics_addr: str, name: str) -> dict | None:
    try:
        return next((s for s in segments(metrics_addr) if s.get("segment_name") == name), None)
    except (OSError, ValueError):
        return None


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the process that started it dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(cmd: list[str], env: dict[str, str] | None, log_path: Path) -> subprocess.Popen:
    """A child in its own session (a terminal's Ctrl-C goes to the parent, which stops it) that
    dies with its parent: no orphaned master or store after a crashed test or command."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )


def stop(proc: subprocess.Popen | None, timeout_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)
