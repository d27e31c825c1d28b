"""`radixserve epp`: the router's picking (its policies, indexes, health checks and load reads:
`proxy.app.Router`) behind the Gateway API's endpoint-picker shell (`epp/`). Lives apart from
both so that proxy/ and epp/ never import each other."""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
    group.add_argument(
        "--fallback-endpoints",
        type=int,
        default=2,
        help="other workers (least loaded first) that follow the pick in "
        "x-gateway-destination-endpoint, where the proxy retries when the pick fails; 0: none",
    )
    group.add_argument(
        "--endpoints-file",
        default=None,
        help="keep the workers' endpoints in this file as Envoy EDS (the inference_pool "
        "cluster of deploy/envoy/envoy-epp.yaml reads it), replaced whenever they change",
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM."""
    try:
        config = from_args(RouterConfig, args)
        if args.fallback_endpoints < 0:
            raise ValueError("--fallback-endpoints must be >= 0")
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
        asyncio.run(serve(config, args))
    except (ValueError, OSError, RuntimeError) as e:  # a port in use, a bad worker url
        print(f"radixserve epp: {e}", file=sys.stderr)
        return 2
    return 0


class RouterPicker:
    """The epp.service.Picker over a Router: the policy's pick, then up to `fallbacks` other
    workers for the proxy's retries. A request the proxy says another endpoint served failed
    on the pick: that counts against it and it is probed at once. With --enable-trace, each
    pick is a `radixserve.epp` span (continuing the request's traceparent) over its
    `radixserve.route.decision`, and the engine is sent a traceparent under it."""

    def __init__(self, router: Any, fallbacks: int = 2) -> None:
        from radixserve.router.proxy import external

        self.router, self.external, self.tracer = router, external, router.tracer
        self.fallbacks = fallbacks
        self.rechecks: dict[Any, asyncio.Task[None]] = {}  # worker -> its probe under way

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
        others = self.external.fallbacks(self.router, worker, allowed, self.fallbacks)
        endpoint = self.external.endpoint
        pick = Pick(endpoint(worker), (worker, view, span), [endpoint(w) for w in others])
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
        failed_over = served is not None and served != self.external.endpoint(worker)
        if failed_over:
            log.warning("picked %s, the proxy says %s served: the pick failed", worker.url, served)
            self._recheck(worker)
        self.external.settled(self.router, worker, view, status, failed_over)
        if span is not None:  # the request's response headers are back (or its stream ended)
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            span.end()

    def _recheck(self, worker: Any) -> None:
        """Probe `worker` once now (one probe at a time per worker, however many failed)."""
        if worker not in self.rechecks:
            task = asyncio.get_running_loop().create_task(
                self.external.recheck(self.router, worker)
            )
            self.rechecks[worker] = task
            task.add_done_callback(lambda _: self.rechecks.pop(worker, None))

    def ready(self) -> bool:
        return self.router.registry.routable() > 0


async def serve(config: RouterConfig, args: argparse.Namespace) -> None:
    """The router (admin, metrics, health checks, KV events) and the ext_proc service; the
    endpoints file, when asked for, is written before the service listens."""
    from radixserve.router.epp.service import start_grpc
    from radixserve.router.follow import Followers
    from radixserve.router.proxy.app import Router
    from radixserve.router.proxy.external import discovery_changes

    followers = Followers(config.discovery, args.worker_file)  # no client or cluster config: now
    router = Router(config)
    http_port = await router.start()
    loop, tasks = asyncio.get_running_loop(), []
    if args.endpoints_file:
        written = write_endpoints(router, args.endpoints_file, None, 0)  # before Envoy starts
        tasks.append(loop.create_task(keep_endpoints(router, args.endpoints_file, written)))
    picker = RouterPicker(router, args.fallback_endpoints)
    server, bound, stop_ready = await start_grpc(picker, args.grpc_host, args.grpc_port)
    if not bound:
        raise OSError(f"cannot listen on {args.grpc_host}:{args.grpc_port}")
    log.info("endpoint picker: ext_proc on %s:%d, admin and metrics on http://%s:%d, %d "
             "worker(s), policy %s", args.grpc_host, bound, config.host, http_port,
             len(config.worker_urls), config.policy)  # fmt: skip
    followers.start(*discovery_changes(router))
    await _until_signalled()
    followers.stop()
    for task in tasks:
        task.cancel()
    stop_ready()
    await server.stop(1.0)
    await router.stop()


async def _until_signalled() -> None:
    stop, loop = asyncio.Event(), asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def write_endpoints(router: Any, path: str, written: list[str] | None, version: int) -> list[str]:
    """Write the workers' endpoints to `path` as Envoy EDS when they differ from `written`;
    returns what the file lists now. One named by host, not address, is left out (and said):
    Envoy's EDS takes addresses, as the Gateway API names endpoints."""
    from radixserve.router.epp import endpoints_file
    from radixserve.router.proxy import external

    now = sorted(external.endpoint(w) for w in router.registry.workers)
    if now == written:
        return written
    for name in set(now) - set(written or []):
        if endpoints_file.split(name) is None:
            log.warning("endpoints file: %s is not an IP address and is left out", name)
    endpoints_file.write(path, now, version)
    return now


async def keep_endpoints(router: Any, path: str, written: list[str], every: float = 0.5) -> None:
    """Rewrite the endpoints file whenever a worker joins or leaves."""
    for version in itertools.count(1):
        await asyncio.sleep(every)
        try:
            written = write_endpoints(router, path, written, version)
        except OSError as exc:  # a full or read-only disk: said, tried again next time
            log.warning("endpoints file %s: %s", path, exc)
