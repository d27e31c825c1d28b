"""`radixserve serve`: flags from ServerConfig and the engine's configs; `run(args)` launches the
engine, then serves HTTP on it until SIGINT or SIGTERM (uvloop when installed)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from radixserve.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    add_dataclass_args,
    from_args,
)
from radixserve.server.config import ServerConfig

if TYPE_CHECKING:
    from radixserve.engine.launch import EngineProcesses

log = logging.getLogger("radixserve.server")
GRACEFUL_SHUTDOWN_S = 5  # open streams are cut after this once told to stop


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `serve` subcommand."""
    parser = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server for one engine",
        description="Serve one model (or a simulated one) over HTTP: OpenAI /v1/completions "
        "and /v1/chat/completions, SGLang /generate, health, info and Prometheus /metrics.",
    )
    add_dataclass_args(parser, ServerConfig, "server")
    add_dataclass_args(parser, ModelConfig, "model")
    add_dataclass_args(parser, CacheConfig, "cache")
    add_dataclass_args(parser, SchedulerConfig, "scheduler")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Launch the engine before binding, so that the server is ready once it listens."""
    from radixserve.engine.launch import EngineConfig, EngineStartError, launch

    try:
        server = from_args(ServerConfig, args)
        engine_config = EngineConfig(from_args(ModelConfig, args), from_args(CacheConfig, args),
                                     from_args(SchedulerConfig, args), sim=server.sim)  # fmt: skip
    except ValueError as e:
        print(f"radixserve serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    what = f"simulated {server.sim}" if server.sim else (engine_config.model.model or "built-in")
    print(f"radixserve: starting the engine ({what})", flush=True)
    try:
        engine = launch(engine_config)
    except EngineStartError as e:
        print(f"radixserve serve: {e}", file=sys.stderr)
        return 1
    try:
        _run_loop(serve(server, engine))
    finally:
        engine.shutdown()
    return 0


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


async def serve(config: ServerConfig, engine: EngineProcesses) -> None:
    """Serve a launched engine until told to stop; prints the address once bound."""
    import uvicorn

    from radixserve.server.app import create_app

    app = create_app(config, engine)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        access_log=config.access_log, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    ))  # fmt: skip
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1]
        name = app.state.server.model_name
        host = f"[{config.host}]" if ":" in config.host else config.host
        print(f"radixserve: serving {name} on http://{host}:{port}", flush=True)
    await task
