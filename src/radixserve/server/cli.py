"""`radixserve serve`: flags from ServerConfig and the engine's configs; `run(args)` launches the
engine, then serves HTTP on it until SIGINT or SIGTERM (uvloop when installed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from radixserve.config import (
    CacheConfig,
    DisaggConfig,
    ModelConfig,
    SchedulerConfig,
    TraceConfig,
    add_check,
    add_dataclass_args,
    from_args,
)
from radixserve.net import bind
from radixserve.server.config import ServerConfig

if TYPE_CHECKING:
    from radixserve.engine.launch import EngineProcesses

log = logging.getLogger("radixserve.server")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
FLUSH_S = 1.0  # time left to send the 503s of requests ended at shutdown, before uvicorn cuts


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `serve` subcommand."""
    parser = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server for one engine",
        description="Serve one model (or a simulated one) over HTTP: OpenAI /v1/completions "
        "and /v1/chat/completions, SGLang /generate, health, info and Prometheus /metrics.",
    )
    add_dataclass_args(parser, ServerConfig, "server", check=False)
    add_dataclass_args(parser, ModelConfig, "model", check=False)
    add_dataclass_args(parser, CacheConfig, "cache", check=False)
    add_dataclass_args(parser, SchedulerConfig, "scheduler", check=False)
    add_dataclass_args(parser, DisaggConfig, "prefill/decode disaggregation", check=False)
    add_dataclass_args(parser, TraceConfig, "tracing", check=False)
    parser.add_argument_group("kv events").add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help="publish KV-cache events as vLLM does, e.g. '{\"endpoint\": \"tcp://*:5557\", "
        "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"\", \"block_size\": 16}' "
        "(vLLM's and SGLang's keys, plus block_size, hash_algo, hash_seed)",
    )  # fmt: skip
    parser.add_argument_group("kv store").add_argument(
        "--sim-kv-store", default=None, metavar="JSON",
        help="with --sim: write each prefilled prompt's pages to a KV store as small placeholder "
        "objects under the real keys (routers find them through the store's metadata), e.g. "
        "'{\"backend\": \"mooncake\", \"master_server_address\": \"127.0.0.1:P\", "
        "\"te_port_range\": \"20000-20063\", \"client_port_range\": \"20100-20115\", "
        "\"chunk_size\": 256, \"hash_algo\": \"sha256_cbor\", \"seed\": 0}'",
    )  # fmt: skip
    add_check(parser, configs)  # every setting is checked before any process starts
    parser.set_defaults(run=run)
    return parser


def configs(args: argparse.Namespace) -> tuple[ServerConfig, Any]:
    """ServerConfig and EngineConfig from the flags; ValueError says what is wrong."""
    from radixserve.engine.kv_events import KVEventsConfig
    from radixserve.engine.launch import EngineConfig
    from radixserve.sched.validate import check_config

    server = from_args(ServerConfig, args)
    events = getattr(args, "kv_events_config", None)
    engine_config = EngineConfig(from_args(ModelConfig, args), from_args(CacheConfig, args),
                                 from_args(SchedulerConfig, args), sim=server.sim,
                                 sim_vocab_size=server.sim_vocab_size,
                                 kv_events=None if events is None
                                 else KVEventsConfig.from_json(events),
                                 sim_kv_store=None if args.sim_kv_store is None
                                 else _json_object(args.sim_kv_store),
                                 disagg=from_args(DisaggConfig, args),
                                 trace=from_args(TraceConfig, args))  # fmt: skip
    check_config(engine_config.sched, engine_config.cache.page_size)
    return server, engine_config


def run(args: argparse.Namespace) -> int:
    """Bind the address first (a port in use fails at once, not after loading the model), then
    launch the engine, then listen: the server is ready once it accepts connections."""
    try:
        server, engine_config = configs(args)
    except ValueError as e:
        print(f"radixserve serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    try:
        sock = bind(server.host, server.port)
    except OSError as e:
        print(f"radixserve serve: cannot listen on {server.host}:{server.port}: {e}",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        boot = _bootstrap_socket(engine_config.disagg)
    except OSError as e:
        port = engine_config.disagg.disaggregation_bootstrap_port
        print(f"radixserve serve: error: --disaggregation-bootstrap-port {port}: {e}",
              file=sys.stderr)  # fmt: skip
        sock.close()
        return 2
    stops = StopSignals()
    previous = {s: signal.signal(s, stops.handle) for s in STOP_SIGNALS}
    try:
        return _launch_and_serve(server, engine_config, sock, stops, boot)
    except KeyboardInterrupt:  # SIGINT or SIGTERM while the engine starts
        print("radixserve serve: stopped while starting the engine", file=sys.stderr)
        return 1
    finally:
        sock.close()
        if boot is not None:
            boot.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _bootstrap_socket(disagg: DisaggConfig) -> socket.socket | None:
    """A prefill engine's bootstrap port, bound before the model loads (in use: exit 2)."""
    if disagg.disaggregation_mode != "prefill":
        return None
    from radixserve.engine.pd_bootstrap import bind_bootstrap

    return bind_bootstrap("0.0.0.0", disagg.disaggregation_bootstrap_port)


def _launch_and_serve(
    server: ServerConfig, engine_config: Any, sock: socket.socket, stops: StopSignals,
    boot: socket.socket | None = None,
) -> int:  # fmt: skip
    from radixserve.engine.launch import EngineStartError, launch

    what = f"simulated {server.sim}" if server.sim else (engine_config.model.model or "built-in")
    print(f"radixserve: starting the engine ({what})", flush=True)
    try:
        engine = launch(engine_config)
    except EngineStartError as e:
        print(f"radixserve serve: {e}", file=sys.stderr)
        return 1
    bootstrap = None
    try:
        if boot is not None:
            from radixserve.engine.pd_bootstrap import BootstrapServer

            bootstrap = BootstrapServer(boot, engine.info["disaggregation"])
        stops.started = True
        _run_loop(serve(server, engine, sock, stops))
    finally:
        if bootstrap is not None:
            bootstrap.close()
        engine.shutdown()
    return 0


class StopSignals:
    """SIGINT and SIGTERM outside uvicorn's own handling. While the engine starts they interrupt
    it (KeyboardInterrupt); after, they are noted, and ``serve`` stops uvicorn once it runs (a
    signal just before uvicorn installs its handlers, or the one uvicorn raises again after
    stopping, whose default action would end the process before the engine is shut down)."""

    def __init__(self) -> None:
        self.started = False
        self.got: list[int] = []

    def handle(self, signum: int, _: Any) -> None:
        if not self.started:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        self.got.append(signum)


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


async def serve(
    config: ServerConfig, engine: EngineProcesses, sock: socket.socket,
    stops: StopSignals | None = None,
) -> None:  # fmt: skip
    """Serve a launched engine on a bound socket until told to stop; prints the address once
    listening."""
    import uvicorn

    from radixserve.server.app import create_app

    app = create_app(config, engine)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=config.graceful_shutdown_secs + FLUSH_S,
    ))  # fmt: skip
    port = sock.getsockname()[1]  # read now: uvicorn closes the socket when it stops
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        server.should_exit |= bool(stops and stops.got)  # a signal before uvicorn's handlers
        await asyncio.sleep(0.05)
    if server.started:
        name = app.state.server.model_name
        host = f"[{config.host}]" if ":" in config.host else config.host
        print(f"radixserve: serving {name} on http://{host}:{port}", flush=True)
    await _end_requests_at_exit(
        server, task, app.state.server, config.graceful_shutdown_secs, stops
    )
    await task


async def _end_requests_at_exit(
    server: Any, task: asyncio.Task, state: Any, grace: float, stops: StopSignals | None
) -> None:
    """Once told to stop, give running requests ``grace`` seconds, then end them with a 503:
    a stream then closes with an error event and ``[DONE]`` rather than being cut mid-way."""
    while not server.should_exit and not task.done():
        server.should_exit |= bool(stops and stops.got)
        await asyncio.sleep(0.2)
    done, _ = await asyncio.wait({task}, timeout=grace)
    if not done and (n := state.fail_all("the server is shutting down")):
        log.warning("ended %d running request(s): the server is shutting down", n)


def _json_object(text: str) -> dict:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--sim-kv-store is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("--sim-kv-store must be a JSON object")
    return obj
