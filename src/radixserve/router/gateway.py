"""`radixserve epp`: the router's picking (its policies, indexes, health checks and load reads:
`proxy.app.Router`) behind the Gateway API's endpoint-picker shell (`epp/`). Lives apart from
both so that proxy/ and epp/ never import each other."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Any

from radixserve.config import add_dataclass_args, from_args
from radixserve.router.proxy.config import RouterConfig

log = logging.getLogger("radixserve.epp")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `epp` subcommand: route's flags, plus where the gRPC service listens."""
    parser = subparsers.add_parser(
        "epp",
        help="the Gateway API's endpoint picker (Envoy ext_proc) with the router's policies",
        description="Pick the endpoint for each request Envoy forwards, as `route` would.",
    )
    add_dataclass_args(parser, RouterConfig, "router")
    group = parser.add_argument_group("endpoint picker")
    group.add_argument("--grpc-host", default="0.0.0.0", help="address of the ext_proc service")
    group.add_argument("--grpc-port", type=int, default=9002, help="port of the ext_proc service")
    group.add_argument(
        "--worker-file",
        default=None,
        help="a file listing workers (a url a line, or JSON), re-read when it changes: workers "
        "it adds join, workers it drops leave (--worker-urls stay)",
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM."""
    try:
        config = from_args(RouterConfig, args)
        import grpc  # noqa: F401  (the epp extra)
    except ValueError as e:
        print(f"radixserve epp: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("radixserve epp: needs the epp extra: pip install 'radixserve[epp]'", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(config, args.grpc_host, args.grpc_port, args.worker_file))
    except (ValueError, OSError, RuntimeError) as e:  # a port in use, a bad worker url
        print(f"radixserve epp: {e}", file=sys.stderr)
        return 2
    return 0


class RouterPicker:
    """The epp.service.Picker over a Router; with --enable-trace, each pick is a
    `radixserve.epp` span (continuing the request's traceparent) over its
    `radixserve.route.decision`, and the engine is sent a traceparent under it."""

    def __init__(self, router: Any) -> None:
        from radixserve.router.proxy import external

        self.router, self.external, self.tracer = router, external, router.tracer

    async def pick(
        self, body: bytes, path: str, allowed: set[str] | None, traceparent: str | None = None
    ) -> Any:
        from radixserve.router.epp.service import Pick

        span = self._open(path, traceparent)
        picking = time.time_ns()
        try:
            found = await self.external.choose(self.router, body or b"{}", path, allowed)
        except (ValueError, TypeError, AttributeError) as exc:
            return self._refused(
                span, Pick(None, status=400, message=f"request body is not a JSON object: {exc}")
            )
        if found is None:
            return self._refused(span, self._none_fits(allowed))
        worker, view = found
        self.external.dispatched(self.router, worker, view)
        pick = Pick(self.external.endpoint(worker), (worker, view, span))
        if span is not None:
            pick.headers["traceparent"] = self._decided(span, worker, picking)
        return pick

    def _none_fits(self, allowed: set[str] | None) -> Any:
        from radixserve.router.epp.service import Pick

        if self.external.shedding(self.router):
            msg = "every worker reports a queue or KV usage past the overload threshold"
            return Pick(None, status=429, message=msg)
        why = "none of the endpoints in the subset hint" if allowed is not None else "none"
        return Pick(None, status=503, message=f"no healthy worker available ({why} fits)")

    def _open(self, path: str, traceparent: str | None) -> Any:
        """The request's span, or None when not tracing."""
        if self.tracer is None:
            return None
        return self.tracer.start(
            "radixserve.epp", traceparent or None, "server", {"url.path": path}
        )

    def _decided(self, span: Any, worker: Any, picking: int) -> str:
        """Record the decision (the policy has counted its expected hit by now); returns the
        traceparent the engine gets, so that its spans sit under this request's."""
        policy = self.router.policy
        attrs: dict[str, Any] = {"radixserve.routing.policy": self.router.config.policy,
                                 "radixserve.routing.worker": worker.url,
                                 "radixserve.routing.worker_id": worker.id}  # fmt: skip
        if policy.last_hit is not None:  # tokens with a KV index, the tree's units without
            unit = "tokens" if policy.index is not None else "units"
            attrs[f"radixserve.routing.expected_hit_{unit}"] = policy.last_hit
        self.tracer.record("radixserve.route.decision", span, picking, time.time_ns(), attrs)
        return self.tracer.traceparent(span)

    @staticmethod
    def _refused(span: Any, pick: Any) -> Any:
        """No endpoint: the span ends with the status the EPP answers."""
        if span is not None:
            span.set_attribute("http.response.status_code", pick.status)
            span.set_attribute("error.type", str(pick.status))
            span.end()
        return pick

    def done(self, handle: Any, status: int | None, served: str | None) -> None:
        worker, view, span = handle
        if served is not None and served != self.external.endpoint(worker):
            log.warning("picked %s, the proxy says %s served", worker.url, served)
        self.external.settled(self.router, worker, view, status)
        if span is not None:  # the request's response headers are back (or its stream ended)
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            span.end()

    def ready(self) -> bool:
        return self.router.registry.routable() > 0


async def serve(
    config: RouterConfig, grpc_host: str, grpc_port: int, worker_file: str | None = None
) -> None:
    """The router (admin, metrics, health checks, KV events) and the ext_proc service."""
    from radixserve.router.epp.service import start_grpc
    from radixserve.router.proxy.app import Router

    router = Router(config)
    http_port = await router.start()
    server, bound, stop_ready = await start_grpc(RouterPicker(router), grpc_host, grpc_port)
    if not bound:
        raise OSError(f"cannot listen on {grpc_host}:{grpc_port}")
    log.info("endpoint picker: ext_proc on %s:%d, admin and metrics on http://%s:%d, %d "
             "worker(s), policy %s", grpc_host, bound, config.host, http_port,
             len(config.worker_urls), config.policy)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    watching = loop.create_task(watch_file(router, worker_file)) if worker_file else None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if watching is not None:
        watching.cancel()
    stop_ready()
    await server.stop(1.0)
    await router.stop()


async def watch_file(router: Any, path: str, every: float = 1.0) -> None:
    """Re-read the worker file whenever its modification time or size changes, and make the
    workers it listed last match it; an unreadable or malformed file changes nothing (said once)."""
    import os

    from radixserve.router.discovery import parse_worker_file
    from radixserve.router.proxy import external

    seen, listed = None, set()
    while True:
        try:
            st = os.stat(path)
            if (st.st_mtime_ns, st.st_size) != seen:
                seen = (st.st_mtime_ns, st.st_size)
                with open(path) as f:
                    wanted = set(parse_worker_file(f.read()))
                listed = await _reconcile(router, external, listed, wanted)
        except (OSError, ValueError) as exc:
            log.warning("worker file %s: %s (workers unchanged)", path, exc)
        await asyncio.sleep(every)


async def _reconcile(router: Any, external: Any, listed: set[str], wanted: set[str]) -> set[str]:
    """Workers the file listed before and no longer does leave; new ones join."""
    for url in sorted(listed - wanted):
        await external.leave(router, url)
        log.info("worker file: %s left", url)
    for url in sorted(wanted - listed):
        await external.join(router, url)
        log.info("worker file: %s joined", url)
    return wanted
