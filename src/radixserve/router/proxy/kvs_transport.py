"""How `--kv-index mooncake://` lookups reach the master: over the router's own keep-alive
HTTP client (upstream_pool), as kvindex's MasterHttp; httpx's client collapsed under concurrent
lookups (kvindex/mooncake_client.py says by how much)."""

from __future__ import annotations

from radixserve.router.proxy.upstream_pool import ConnectionPool

MAX_CONNS = 32  # lookups in flight to the master at once; more wait their turn


class PooledMaster:
    """MasterHttp over a ConnectionPool to the master's HTTP (metrics) port."""

    def __init__(self, address: str, connect_timeout: float = 5.0) -> None:
        self.pool = ConnectionPool(
            f"http://{address}", max_idle=MAX_CONNS, connect_timeout=connect_timeout,
            max_conns=MAX_CONNS,
        )  # fmt: skip

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        resp = await self.pool.request("GET", path, timeout=timeout)
        return resp.status, resp.body

    async def aclose(self) -> None:
        self.pool.close()
