"""A real Mooncake Store for the tests that need one: `mooncake_master` and one store process
(`mooncake_client` holding the shared segment) on free loopback ports, every port and MC_* port
range set explicitly; master and store can be killed and restarted on the same ports; always
stopped. Skips with the reason when the wheel is missing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from radixserve.kvstore import mooncake_procs as mp

SEGMENT_BYTES = 256 << 20


_IMPORT_ERROR: list[str] = []  # the answer of the one check this process makes


def require_mooncake() -> None:
    """Skip unless the non-CUDA wheel imports (it also needs Debian's libibverbs1). Checked in a
    child process: loading Mooncake here would fix this process's port ranges too early."""
    if not _IMPORT_ERROR:
        probe = subprocess.run([sys.executable, "-c", "import mooncake.store"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        lines = probe.stderr.strip().splitlines()
        _IMPORT_ERROR.append("" if probe.returncode == 0 else (lines or ["?"])[-1])
    if _IMPORT_ERROR[0]:
        pytest.skip(
            "Mooncake Store is not installed: pip install "
            "mooncake-transfer-engine-non-cuda==0.3.13.post1 and apt-get install libibverbs1 "
            f"({_IMPORT_ERROR[0]})"
        )


_PINNED: dict[str, str] = {}


def pin_this_process() -> dict[str, str]:
    """This (test) process's own MC_* windows, set once before Mooncake loads here."""
    if not _PINNED:
        _PINNED.update(mp.port_env(mp.port_window(), mp.port_window(16)))
        os.environ.update(_PINNED)
    return dict(_PINNED)


def backend_ports(env: dict[str, str]) -> dict[str, str]:
    """The same windows as the mooncake backend's extra-config keys."""
    return {
        "te_port_range": f"{env['MC_MIN_RPC_PORT']}-{env['MC_MAX_RPC_PORT']}",
        "client_port_range": f"{env['MC_STORE_CLIENT_MIN_PORT']}-{env['MC_STORE_CLIENT_MAX_PORT']}",
    }


class MooncakeCluster:
    """One master and one store process. `client_env()` gives a new client process its ports."""

    def __init__(self, segment_bytes: int = SEGMENT_BYTES, client_ttl_s: int = 10) -> None:
        require_mooncake()
        self.segment_bytes, self.client_ttl_s = segment_bytes, client_ttl_s
        self.dir = tempfile.TemporaryDirectory(prefix="radixserve-mooncake-")
        self.ports = mp.MasterPorts.free()
        self.store_client_port, self.store_service_port = mp.free_port(), mp.free_port()
        self.store_env = mp.port_env(mp.port_window(), mp.port_window(16))
        self.master = self.store = None
        try:
            self.start_master()
            self.start_store()
        except BaseException:
            self.stop()
            raise

    @property
    def master_rpc(self) -> str:
        return f"127.0.0.1:{self.ports.rpc}"

    @property
    def metrics_addr(self) -> str:
        return f"127.0.0.1:{self.ports.metrics}"

    @property
    def store_segment(self) -> str:
        return f"127.0.0.1:{self.store_client_port}"

    @property
    def store_endpoint(self) -> str:
        """The store process's transfer endpoint: what /batch_query_keys names for its objects."""
        seg = mp.segment_of(self.metrics_addr, self.store_segment)
        assert seg is not None, "the store's segment is mounted"
        return seg["te_endpoint"]

    def log(self, name: str) -> Path:
        return Path(self.dir.name) / f"{name}.log"

    def client_env(self) -> dict[str, str]:
        """MC_* port ranges for one more client process (its own windows)."""
        return mp.port_env(mp.port_window(), mp.port_window(16))

    def start_master(self) -> None:
        cmd = mp.master_command(self.ports, self.client_ttl_s)
        self.master = mp.spawn(cmd, None, self.log("master"))
        mp.wait_until(lambda: mp.master_healthy(self.metrics_addr), "mooncake_master",
                      self.master, mp.READY_TIMEOUT_S)  # fmt: skip

    def start_store(self) -> None:
        cmd = mp.store_command(self.master_rpc, "127.0.0.1", self.store_client_port,
                               self.store_service_port, self.segment_bytes)  # fmt: skip
        self.store = mp.spawn(cmd, self.store_env, self.log("store"))
        self.wait_store_mounted()

    def wait_store_mounted(self, timeout_s: float = mp.READY_TIMEOUT_S) -> None:
        """Until the master lists the store's segment (after a master restart it remounts)."""
        mp.wait_until(lambda: mp.segment_of(self.metrics_addr, self.store_segment) is not None,
                      "mooncake store segment", self.store, timeout_s)  # fmt: skip

    def kill_master(self) -> None:
        _kill(self.master)

    def kill_store(self) -> None:
        _kill(self.store)

    def stop(self) -> None:
        mp.stop(self.store)
        mp.stop(self.master)
        self.dir.cleanup()


def _kill(proc) -> None:
    """SIGKILL, as a crash would."""
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
