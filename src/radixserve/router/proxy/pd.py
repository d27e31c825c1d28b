"""The router's prefill/decode mode (``--pd-disaggregation``): for each request a pair (the
prefill policy picks among the prefill workers, since the prefix is cached where the prompt is
computed; the decode policy among the decode workers), SGLang's bootstrap fields filled with a
fresh room, both requests sent at once, the decode worker's answer relayed (streams as they
arrive) with the prefill side's input logprobs merged in, and a failed pair retried on another
while nothing has reached the client."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from radixserve.router.policies.base import NoWorkerAvailable, RequestView, WorkerView
from radixserve.router.policies.registry import create_policy
from radixserve.router.policies.tree_keys import units
from radixserve.router.proxy.config import DEFAULT_BOOTSTRAP_PORT
from radixserve.router.proxy.connections import ClientConn, Request, passback
from radixserve.router.proxy.errors import error_body, error_for, speaks_anthropic
from radixserve.router.proxy.pd_merge import (
    EventMerger,
    merge_whole,
    prompt_logprobs,
    refusal,
    wants_merge,
    with_bootstrap,
)
from radixserve.router.proxy.workers import Headers, Response, UpstreamError, Worker, resolve

try:  # 5x faster on long prompts; the stdlib parser is the fallback
    from orjson import loads
except ImportError:  # pragma: no cover
    from json import loads

if TYPE_CHECKING:
    from radixserve.router.policies.base import RouterPolicy

log = logging.getLogger("radixserve.router")
RETRYABLE = frozenset({502, 503, 504})
ROLES = ("prefill", "decode")


class Failure(NamedTuple):
    """Why an attempt failed (as forwarding.Failure): what to answer if it is the last, whether to
    try again, whether the worker's connection died holding the request."""

    why: str
    status: int
    retry: bool
    lost: bool


class Lost(NamedTuple):
    """An attempt that failed, and the worker of the pair that failed it."""

    failure: Failure
    worker: Worker


class PdDispatch:
    """The PD half of a Router: pairs, sends, relays, retries. The router's own policy is the
    prefill policy (its tree, KV index and metrics are the prefill workers'); the decode policy
    is this object's."""

    def __init__(self, router: Any) -> None:  # the Router (app.py), which imports this module
        self.router = router
        cfg = router.config
        self.decode_policy = create_policy(cfg.decode_policy, cfg.cache_policy)

    def policy(self, role: str) -> RouterPolicy:
        return self.router.policy if role == "prefill" else self.decode_policy

    async def add_configured(self) -> None:
        """--prefill and --decode, registered with their roles and admitted in the background."""
        cfg, r = self.router.config, self.router
        entries = [(u, "prefill", p or DEFAULT_BOOTSTRAP_PORT) for u, p in cfg.prefill]
        entries += [(u, "decode", None) for u in cfg.decode]
        for url, role, port in entries:
            worker = r.registry.add(url, await resolve(url), role=role, bootstrap_port=port)
            r.kinds.register(worker.id, worker.url)
            r.admit_later(worker)

    # ----- one request -----

    async def proxy(self, conn: ClientConn, req: Request) -> None:
        """Pair, send, relay; retry on another pair while the client has nothing yet."""
        r = self.router
        try:
            body = loads(req.body)
            if not isinstance(body, dict):
                raise ValueError("not an object")
            view = await r._request_view(req.body, req.path)
        except (ValueError, TypeError, AttributeError) as exc:
            msg = f"request body is not a JSON object: {exc}"
            conn.send_json(400, error_for(req.path, 400, msg))
            return
        if req.path == "/v1/messages/count_tokens":  # no generation: any prefill worker counts
            return await self._count_tokens(conn, req, view)
        refused = refusal(body, req.path)
        if refused is not None:
            conn.send_json(400, _refusal_body(req.path, *refused))
            return
        await self._attempts(conn, req, body, view)

    async def _count_tokens(self, conn: ClientConn, req: Request, view: RequestView) -> None:
        worker = self.pick("prefill", view, [])
        if worker is None:
            return self._unavailable(conn, req, "prefill", {"prefill": [], "decode": []})
        failure = await self.router.attempt(conn, req, worker, view)
        if failure is not None:
            self.router.fail(conn, req, [worker.id], failure.status)

    async def _attempts(
        self, conn: ClientConn, req: Request, body: dict[str, Any], view: RequestView
    ) -> None:
        r, tried = self.router, {role: [] for role in ROLES}
        lost, last = 0, None
        for attempt in range(r.config.max_retries + 1):
            if attempt:
                r.retries += 1
                await asyncio.sleep(r._backoff(attempt))
            if r.kvs is not None:  # the shared index's answer, read by select just below
                await r.kvs.prepare(view.token_ids, view.kv_namespace)
            pair = [self.pick(role, view, tried[role]) for role in ROLES]
            missing = [role for role, w in zip(ROLES, pair) if w is None]
            if missing:
                return self._unavailable(conn, req, missing[0], tried)
            last = await self.attempt(conn, req, body, view, pair[0], pair[1])
            if last is None:
                return None
            tried[last.worker.role].append(last.worker.id)
            log.warning("request %s: attempt %d on %s (%s) failed: %s", req.rid, attempt + 1,
                        last.worker.url, last.worker.role, last.failure.why)  # fmt: skip
            lost += last.failure.lost
            if not last.failure.retry or lost > 1:  # a request that killed a worker kills no more
                break
        r.fail(conn, req, tried["prefill"] + tried["decode"], last.failure.status)

    def _unavailable(
        self, conn: ClientConn, req: Request, role: str, tried: dict[str, list[str]]
    ) -> None:
        r = self.router
        if tried["prefill"] or tried["decode"]:
            r.fail(conn, req, tried["prefill"] + tried["decode"], 502)
            return
        r.failed[503] += 1
        msg = f"no healthy {role} worker available"
        conn.send_json(503, error_for(req.path, 503, msg, "service_unavailable"))

    def pick(self, role: str, view: RequestView, tried: list[str]) -> Worker | None:
        """The role's policy's choice among the role's routable workers, avoiding those this
        request failed on while others are left."""
        r, now = self.router, time.monotonic()
        workers = [w for w in r.registry.workers if w.role == role]
        policy = self.policy(role)
        for exclude in (set(tried) | r.registry.overloaded, r.registry.overloaded):
            views = [_view(w, now, exclude) for w in workers]
            try:
                return workers[policy.select(views, view, now)]
            except NoWorkerAvailable:
                continue
        return None

    async def attempt(
        self, conn: ClientConn, req: Request, body: dict[str, Any], view: RequestView,
        p: Worker, d: Worker,
    ) -> Lost | None:  # fmt: skip
        """One pair: None when the client got its answer, else which worker failed and why."""
        r, cfg = self.router, self.router.config
        payload = with_bootstrap(body, p.url, p.bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
                                 random.getrandbits(63))  # fmt: skip
        relay = Relay(conn, req, wants_merge(body, req.path) and bool(body.get("stream")))
        headers = r._forward_headers(req)
        limit, idle = cfg.request_timeout_secs, cfg.stream_timeout_secs
        for w in (p, d):
            self._begin(w, view)
        loop = asyncio.get_running_loop()
        pt = loop.create_task(p.pool.request("POST", req.path, payload, None, limit, headers,
                                             idle))  # fmt: skip
        dt = loop.create_task(d.pool.request("POST", req.path, payload, relay.on_head, limit,
                                             headers, idle, conn.bind))  # fmt: skip
        pt.add_done_callback(relay.prefill_done)
        try:
            return await self._settle(conn, req, (p, d), (pt, dt), relay)
        finally:
            for t in (pt, dt):
                t.cancel()  # the client left, or the other side failed: the worker sees it
            await asyncio.gather(pt, dt, return_exceptions=True)
            for w in (p, d):
                self._end(w, view)

    async def _settle(
        self, conn: ClientConn, req: Request, pair: tuple[Worker, Worker],
        tasks: tuple[asyncio.Task[Response], asyncio.Task[Response]], relay: Relay,
    ) -> Lost | None:  # fmt: skip
        """Wait for the pair: a side that fails before the client got anything fails the
        attempt at once (the other side is cancelled); else the decode answer goes out."""
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        first = tasks[0] if tasks[0] in done else tasks[1]
        if not _ok(first) and not relay.streamed:
            culprit = pair[0] if _peer_failed(tasks) else pair[tasks.index(first)]
            return self._failed(conn, req, culprit, first, relay)
        await asyncio.wait(tasks)
        if not _ok(tasks[1]):
            return self._failed(conn, req, pair[0 if _peer_failed(tasks) else 1], tasks[1], relay)
        now = time.monotonic()
        for w, t in zip(pair, tasks):
            w.breaker.record(_ok(t), now)
        relay.finish(tasks[1].result(), tasks[0])
        return None

    def _failed(
        self, conn: ClientConn, req: Request, worker: Worker, task: asyncio.Task[Response],
        relay: Relay,
    ) -> Lost | None:  # fmt: skip
        """A side's failure: the worker's own answer when it is the client's to read (a 4xx, a
        500), else a Failure to retry; a stream under way ends with an error event."""
        exc = task.exception()
        now = time.monotonic()
        if exc is None and task.result().status not in RETRYABLE:
            worker.breaker.record(task.result().status < 500, now)
            relay.finish(task.result(), None)  # e.g. the prompt too long: as the worker says it
            return None
        if exc is not None and not isinstance(exc, UpstreamError):
            raise exc
        why = (Failure(str(exc), 504 if exc.timed_out else 502, exc.retryable, exc.lost)
               if exc is not None else Failure(f"status {task.result().status}", 502, True, False))  # fmt: skip
        worker.counts["errors"] += 1
        worker.breaker.record(False, now)
        if not relay.streamed:
            return Lost(why, worker)
        log.warning("request %s: stream from %s cut: %s", req.rid, worker.url, why.why)
        conn.abort_stream(502, f"worker failed mid-stream: {why.why}", req.keep_alive, req.path)
        return None

    def _begin(self, worker: Worker, view: RequestView) -> None:
        worker.load, worker.queued_units = worker.load + 1, worker.queued_units + units(view.key)
        worker.counts["requests"] += 1
        worker.breaker.dispatched()
        self.policy(worker.role).on_dispatch(worker.id, view, time.monotonic())
        self.router._maybe_evict()

    def _end(self, worker: Worker, view: RequestView) -> None:
        worker.load, worker.queued_units = worker.load - 1, worker.queued_units - units(view.key)
        worker.breaker.settled()
        self.policy(worker.role).on_complete(worker.id, view, time.monotonic())


class Relay:
    """The decode worker's answer on its way to the client: streamed as it arrives (through an
    EventMerger when the prefill side's input logprobs go in), or sent whole once both sides
    have answered."""

    def __init__(self, conn: ClientConn, req: Request, merge_stream: bool) -> None:
        self.conn, self.req, self.streamed = conn, req, False
        self.merger = EventMerger(conn.chunk) if merge_stream else None

    def on_head(
        self, status: int, headers: Headers, chunked: bool
    ) -> Callable[[bytes], None] | None:
        if not chunked or status >= 400:
            return None  # buffered: an error may be retried or is the client's to read whole
        self.streamed = True
        self.conn.begin_stream(status, passback(headers, self.req.rid), self.req.http11)
        return self.conn.chunk if self.merger is None else self.merger.feed

    def prefill_done(self, task: asyncio.Task[Response]) -> None:
        if self.merger is None:
            return
        ok = not task.cancelled() and _ok(task)
        self.merger.prefill_done(prompt_logprobs(task.result().body, True) if ok else {})

    def finish(self, resp: Response, prefill: asyncio.Task[Response] | None) -> None:
        """Send (or end the stream of) the decode answer, merged with the prefill task's."""
        if self.streamed:
            if self.merger is not None:
                self.merger.close()
            self.conn.end_stream(self.req.keep_alive)
            return
        body = resp.body
        if prefill is not None and resp.status == 200 and b"input_token_logprobs" in body:
            inputs = prompt_logprobs(prefill.result().body, False) if _ok(prefill) else {}
            body = merge_whole(body, inputs) if inputs else body
        self.conn.send(resp.status, None, body, self.req.keep_alive,
                       passback(resp.headers, self.req.rid))  # fmt: skip


def _refusal_body(path: str, message: str, param: str) -> object:
    """A 400 naming the field at fault: OpenAI's ``param``, or (Anthropic's shape has none)
    the message's lead."""
    if speaks_anthropic(path):
        return error_for(path, 400, message if message.startswith(param) else f"{param}: {message}")
    err = error_body(400, message)
    err["error"]["param"] = param  # type: ignore[index]
    return err


def _peer_failed(tasks: tuple[asyncio.Task[Response], asyncio.Task[Response]]) -> bool:
    """Whether a failed decode side failed because of its prefill peer: the prefill side failed
    too, or the decode engine answered (so it is alive) a 502 or 504, which a decode engine
    says when it cannot reach the prefill side or never gets its pages (a 503, out of room,
    is its own)."""
    prefill, decode = tasks
    if not decode.done() or _ok(decode):
        return False
    if prefill.done() and not _ok(prefill):
        return True
    return decode.exception() is None and decode.result().status in (502, 504)


def _ok(task: asyncio.Task[Response]) -> bool:
    return not task.cancelled() and task.exception() is None and task.result().status < 400


def _view(worker: Worker, now: float, exclude: set[str]) -> WorkerView:
    v = worker.view(now)
    return WorkerView(v.id, v.load, False) if v.id in exclude else v
