"""`--kv-index mooncake://` lookups over the router's own HTTP client (proxy/kvs_transport.py):
a master that refuses connections or answers an error is a failed lookup (retried, then the
service gated down and the decision made without it), never an exception in the router."""

from __future__ import annotations

import asyncio
import http.server
import threading

from radixserve.router.kvindex.mooncake_client import KvsMetadataConfig, MooncakeMetadataClient
from radixserve.router.proxy.kvs_transport import PooledMaster
from test_router_kv_procs import free_port


def lookup(address: str) -> tuple[object, MooncakeMetadataClient]:
    cfg = KvsMetadataConfig(address, retry_times=2, retry_interval_ms=1, down_duration_s=60)
    client = MooncakeMetadataClient(cfg, transport=PooledMaster(address, 1.0))

    async def go() -> object:
        try:
            return await client.aquery(["a", "b"])
        finally:
            await client.aclose()

    return asyncio.run(go()), client


def test_a_refusing_master_is_retried_then_gated_down():
    answer, client = lookup(f"127.0.0.1:{free_port()}")  # nothing listens there
    assert answer is None and not client.up
    assert client.stats.failures == 3 and client.stats.fallbacks == 1


def test_an_error_status_is_a_failed_lookup():
    class Failing(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answer, client = lookup(f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert answer is None and client.stats.failures == 3 and client.stats.queries == 0
