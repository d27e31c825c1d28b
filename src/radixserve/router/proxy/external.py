"""Picking for a front door other than the router's own HTTP server (the Gateway API's endpoint
picker): the same request view, shared-index read, policy choice and in-flight accounting as
`Router.proxy`, with the bytes moved by someone else (Envoy)."""

from __future__ import annotations

import functools
import time
from collections.abc import Collection
from typing import Any
from urllib.parse import urlsplit

from radixserve.router.policies.base import RequestView
from radixserve.router.policies.tree_keys import units
from radixserve.router.proxy.app import Router
from radixserve.router.proxy.workers import Worker


def endpoint(worker: Worker) -> str:
    """The worker's `host:port`, as the Gateway API names an endpoint (an IPv6 host in
    brackets, as Envoy writes a host's address)."""
    parts = urlsplit(worker.url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


async def choose(
    router: Router, body: bytes, path: str, allowed: Collection[str] | None
) -> tuple[Worker, RequestView] | None:
    """The worker the router's policy picks for this request body, among the endpoints in
    `allowed` (None: any); None when no routable worker fits. Raises ValueError on a body that
    is not a JSON object."""
    view = await router._request_view(body, path)
    if router.kvs is not None:  # the shared index's answer, read by select just below
        await router.kvs.prepare(view.token_ids, view.kv_namespace)
    outside = [] if allowed is None else [
        w.id for w in router.registry.workers if endpoint(w) not in allowed
    ]  # fmt: skip
    worker = router.pick(view, outside)
    if worker is None or (allowed is not None and endpoint(worker) not in allowed):
        return None
    return worker, view


def fallbacks(
    router: Router, picked: Worker, allowed: Collection[str] | None, n: int
) -> list[Worker]:
    """Up to `n` other routable workers (in `allowed`, not overloaded), least loaded first: where
    the proxy retries when `picked` fails before it answers."""
    now = time.monotonic()
    others = [w for w in router.registry.workers if w is not picked
              and w.view(now).healthy and w.id not in router.registry.overloaded
              and (allowed is None or endpoint(w) in allowed)]  # fmt: skip
    return sorted(others, key=lambda w: (w.load, w.queued_units))[:n]


def shedding(router: Router) -> bool:
    """No worker was picked because every routable one is past an overload threshold."""
    return bool(router.registry.overloaded) and router.registry.routable() > 0


def dispatched(router: Router, worker: Worker, view: RequestView) -> None:
    """The request went to `worker`: counted in flight there, and recorded by the policy."""
    worker.load, worker.queued_units = worker.load + 1, worker.queued_units + units(view.key)
    worker.counts["requests"] += 1
    worker.breaker.dispatched()
    router.policy.on_dispatch(worker.id, view, time.monotonic())
    router._maybe_evict()


def settled(
    router: Router, worker: Worker, view: RequestView, status: int | None, failed_over: bool
) -> None:
    """The request on `worker` ended (`status`: its HTTP status, None: unknown). A 5xx, which
    is also what the proxy answers when it cannot reach the worker, counts against the worker's
    circuit breaker as a failed attempt through `route` does, and so does `failed_over` (the
    proxy says another endpoint served: `worker` failed before answering, and the proxy's retry
    went on down the fallbacks), so a dead worker is left out at its first failures, not only at
    its next missed health check."""
    now = time.monotonic()
    worker.load, worker.queued_units = worker.load - 1, worker.queued_units - units(view.key)
    worker.breaker.settled()
    if failed_over:
        worker.counts["errors"] += 1
        worker.breaker.record(False, now)
    elif status is not None:
        worker.counts["errors"] += status >= 500
        worker.breaker.record(status < 500, now)
    router.policy.on_complete(worker.id, view, now)


async def recheck(router: Router, worker: Worker) -> None:
    """Probe a worker the proxy saw fail: when it does not answer its health check either, it
    leaves routing at once rather than at its next scheduled checks."""
    await router.registry.recheck(worker)


async def join(router: Router, url: str) -> None:
    """Register a discovered worker as `POST /workers` does; it takes traffic once its first
    health probe passes. A worker already registered (under any spelling) is left as it is."""
    from radixserve.router.proxy.workers import DuplicateWorker, resolve

    try:
        worker = router.registry.add(url, await resolve(url), healthy=False)
    except DuplicateWorker:
        return
    router.kinds.register(worker.id, worker.url)
    if await router.admit(worker):
        await router.registry.probe_now(worker)


async def leave(router: Router, url: str) -> None:
    """Forget a worker discovery no longer lists, as `DELETE /workers/{url}` does."""
    worker = router.registry.get(url)
    if worker is None:
        return
    router.registry.remove(worker)
    router.kinds.forget(worker.id)
    if router.kv is not None:
        await router.kv.forget(worker.id)


def discovery_changes(router: Router) -> tuple[Any, Any]:
    """(join, leave) on this router, as router/follow.py calls them with a url."""
    return functools.partial(join, router), functools.partial(leave, router)


def worker_urls(router: Router) -> set[str]:
    """The urls of the workers registered now."""
    return {w.url for w in router.registry.workers}
