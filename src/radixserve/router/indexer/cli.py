"""`radixserve kv-indexer --worker-urls ... --redis redis://host:port/db` (or the workers found as
Kubernetes pods, --service-discovery, as `route`): its flags
(IndexerConfig), its HTTP face (health, metrics, the router's worker-admin endpoints) and `run`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import add_dataclass_args, from_args
from radixserve.router.discovery import DiscoveryConfig

log = logging.getLogger("radixserve.kv_indexer")


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class IndexerConfig:
    worker_urls: tuple[str, ...] = _f(
        (), "workers to follow at start (more can be added later)", metavar="URL"
    )
    redis: str = _f(
        "redis://127.0.0.1:6379/0", "the Redis that routers read (redis://host:port/db)"
    )
    redis_prefix: str = _f("radixserve", "prefix of every key the indexer writes (it owns them)")
    host: str = _f("127.0.0.1", "address of the admin API")
    port: int = _f(30100, "port of the admin API (0: any free port)")
    health_check_interval_secs: float = _f(1.0, "seconds between health probes of each worker")
    health_failure_threshold: int = _f(
        2, "failed probes in a row after which a worker is dead and its entries leave Redis"
    )
    admin_api_key: str | None = _f(None, "bearer key required on worker management")
    discovery: DiscoveryConfig = field(
        default_factory=DiscoveryConfig,
        metadata={
            "help": "Kubernetes pod discovery, as `route`'s: --service-discovery, --selector"
        },
    )
    log_level: str = _f("info", "logging level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        if not self.redis.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis must be a redis:// URL, not {self.redis!r}")
        if self.health_check_interval_secs <= 0 or self.health_failure_threshold < 1:
            raise ValueError("health_check_interval_secs > 0 and health_failure_threshold >= 1")
        object.__setattr__(self, "worker_urls", tuple(self.worker_urls))


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `kv-indexer` subcommand."""
    parser = subparsers.add_parser(
        "kv-indexer",
        help="follow the workers' KV events into a shared prefix index in Redis",
        description="Subscribe to every worker's KV events and keep, in Redis, which worker "
        "holds which prompt block, for `radixserve route --kv-index redis://...` replicas.",
    )
    add_dataclass_args(parser, IndexerConfig, "kv-indexer")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        config = from_args(IndexerConfig, args)
    except ValueError as exc:
        print(f"radixserve kv-indexer: {exc}", file=sys.stderr)
        return 2
    try:
        import redis  # noqa: F401
    except ImportError:
        print("radixserve kv-indexer: needs redis-py: pip install 'radixserve[redis]'",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    return asyncio.run(serve(config))


async def serve(config: IndexerConfig) -> int:
    import redis.asyncio as aioredis

    from radixserve.net import bind
    from radixserve.router.follow import Followers
    from radixserve.router.indexer.admin import AdminServer
    from radixserve.router.indexer.service import Indexer
    from radixserve.router.kvindex.redis_store import RedisIndexStore
    from radixserve.router.kvindex.redis_writer import RedisIndexWriter

    client = aioredis.Redis.from_url(config.redis, socket_timeout=2.0, socket_connect_timeout=2.0)
    writer = RedisIndexWriter(RedisIndexStore(client, config.redis_prefix))
    indexer = Indexer(writer, config.health_check_interval_secs, config.health_failure_threshold)
    try:
        followers = Followers(config.discovery, None)  # no client or cluster config: one line
        await indexer.start(list(config.worker_urls))
    except ValueError as exc:  # a malformed or repeated worker URL
        print(f"radixserve kv-indexer: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # Redis unreachable at start: say so in one line
        print(f"radixserve kv-indexer: cannot use {config.redis}: {exc}", file=sys.stderr)
        return 1
    followers.start(*_changes(indexer))
    admin = AdminServer(indexer, config.admin_api_key)
    sock = bind(config.host, config.port)
    await admin.start(sock)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"radixserve kv-indexer: following {len(config.worker_urls)} worker(s) into "
          f"{config.redis}; admin on http://{config.host}:{sock.getsockname()[1]}", flush=True)  # fmt: skip
    await stop.wait()
    followers.stop()
    await admin.stop()
    await indexer.stop()
    await client.aclose()
    return 0


def _changes(indexer: Any) -> tuple[Any, Any]:
    """(join, leave) for router/follow.py: a discovered worker followed already (under
    --worker-urls or through the admin API) is left as it is."""

    async def join(url: str) -> None:
        try:
            indexer.add(url)
        except ValueError:  # already followed
            pass

    return join, indexer.remove
