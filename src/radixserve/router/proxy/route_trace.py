"""One routed request's spans (--enable-trace): the request as the router served it, each
routing decision (policy, chosen worker, expected hit) and each attempt on a worker, whose
`traceparent` header the worker receives, so that the engine's spans join the client's trace."""

from __future__ import annotations

import time
from typing import Any

from radixserve.router.proxy.connections import Request
from radixserve.tracing import Tracer


class RouteTrace:
    """Spans of one request: `radixserve.route` (continuing the client's traceparent, or a new
    trace) over a `radixserve.route.decision` and a `radixserve.route.upstream` per attempt."""

    __slots__ = ("tracer", "root", "policy", "picking_at", "picked_at", "upstream", "attempts",
                 "status")  # fmt: skip

    def __init__(self, tracer: Tracer, req: Request, policy: str) -> None:
        self.tracer, self.policy, self.upstream = tracer, policy, None
        attrs = {"http.request.method": req.method, "url.path": req.path,
                 "radixserve.request_id": req.rid}  # fmt: skip
        self.root = tracer.start("radixserve.route", req.trace.decode("latin-1") or None,
                                 "server", attrs)  # fmt: skip
        self.picking_at = self.picked_at = self.attempts = 0
        self.status: int | None = None  # what the client was answered, once known

    def picking(self) -> None:
        """The decision starts (before a shared index is asked)."""
        self.picking_at = time.time_ns()

    def picked(self) -> None:
        self.picked_at = time.time_ns()

    def dispatched(self, worker: Any, policy: Any, attempt: int) -> bytes:
        """Record the decision (the policy has counted its expected hit by now) and open the
        attempt's span; returns the header line that carries it to the worker."""
        if not self.root.is_recording():  # sampled out: the worker is told so, nothing recorded
            return b"traceparent: " + self.tracer.traceparent(self.root).encode() + b"\r\n"
        attrs: dict[str, Any] = {
            "radixserve.routing.policy": self.policy, "radixserve.routing.worker": worker.url,
            "radixserve.routing.worker_id": worker.id, "radixserve.routing.attempt": attempt,
        }  # fmt: skip
        if policy.last_hit is not None:  # tokens with a KV index, the tree's units without
            unit = "tokens" if policy.index is not None else "units"
            attrs[f"radixserve.routing.expected_hit_{unit}"] = policy.last_hit
        self.attempts += 1
        self.tracer.record("radixserve.route.decision", self.root, self.picking_at,
                           self.picked_at, attrs)  # fmt: skip
        self.upstream = self.tracer.start("radixserve.route.upstream", self.root, "client",
                                          {"server.address": worker.url,
                                           "radixserve.routing.attempt": attempt})  # fmt: skip
        return b"traceparent: " + self.tracer.traceparent(self.upstream).encode() + b"\r\n"

    def settled(self, status: int | None, error: str | None = None) -> None:
        """The attempt ended: the worker's status, or why it failed."""
        span, self.upstream = self.upstream, None
        if span is None:
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            self.status = status
        if error is not None:
            span.set_attribute("error.type", error)
        span.end()

    def refused(self, status: int) -> None:
        """No worker served the request: the router answered `status` itself."""
        self.status = status
        self.root.set_attribute("error.type", str(status))

    def finish(self) -> None:
        """The request is answered (or its client went away)."""
        self.root.set_attribute("radixserve.routing.attempts", self.attempts)
        if self.status is not None:
            self.root.set_attribute("http.response.status_code", self.status)
        self.root.end()
