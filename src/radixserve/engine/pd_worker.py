"""The scheduler process's loop hooks for a prefill or decode engine (engine/pd_rooms.py keeps
the rooms): a request with a room in, the peers' messages, the wait bounds, the pages sent
after a forward. An aggregated engine calls none of these."""

from __future__ import annotations

from typing import Any

from radixserve.engine.messages import GenerateReq, KVCancel, KVDest, KVDone, TokenBatch
from radixserve.engine.pd_rooms import DecodeRooms, PrefillRooms, error_out
from radixserve.sched.batch import Batch, StepResult, TokenLogprob
from radixserve.sched.request import Req

PEER_MESSAGES = (KVDest, KVDone, KVCancel)
BUSY_POLL_MS = 50  # while a room waits: how often its bound is checked


def add(worker: Any, msg: GenerateReq, req: Req) -> bool:
    """Take a request with a room; False (an error sent) if it is refused."""
    pd, sched = worker.pd, worker.scheduler
    if msg.bootstrap_room is None:
        worker.push.send_pyobj(error_out(msg.rid, f"a {pd.config.disaggregation_mode} engine "
                                         "serves requests with bootstrap_host, bootstrap_port "
                                         "and bootstrap_room (a PD router fills them)", 400))  # fmt: skip
        return False
    try:
        if isinstance(pd, DecodeRooms):
            pd.admit(msg, req, sched)
        else:
            from radixserve.sched.validate import check_request

            check_request(req, sched.context_length, sched.kv.total, sched.kv.page)
            ready = pd.admit(msg, req)
            if ready is not None:
                try:
                    sched.add_request(ready)
                except ValueError:
                    pd.forget(req.rid)
                    raise
    except ValueError as e:
        worker.push.send_pyobj(error_out(msg.rid, str(e), 400))
        return False
    return True


def on_peer(worker: Any, msg: Any) -> None:
    """A message from the other role's engine."""
    pd, sched = worker.pd, worker.scheduler
    if isinstance(msg, KVDest) and isinstance(pd, PrefillRooms):
        req = pd.on_dest(msg)
        if req is not None and worker.live.get(req.rid) is req:
            sched.add_request(req)
    elif isinstance(msg, KVCancel) and isinstance(pd, PrefillRooms):
        rid = pd.on_cancel(msg)
        if rid is not None:
            _fail(worker, rid, f"the decode engine gave up bootstrap_room {msg.room}", 502)
    elif isinstance(msg, KVDone) and isinstance(pd, DecodeRooms):
        got = pd.on_done(msg, sched)
        if got is None:
            return
        rid, out = got
        if isinstance(out, str):
            _fail(worker, rid, out, 502)
            return
        lp = msg.logprob
        token = worker._token_out(out, lp)
        if token is not None:
            worker.push.send_pyobj(TokenBatch([token]))


def tick(worker: Any) -> int | None:
    """Between steps: rooms past their bound end with an error, a decode engine reserves what
    fits now. Returns how long the loop may block idle (None: as long as it likes)."""
    pd, sched = worker.pd, worker.scheduler
    if isinstance(pd, DecodeRooms):  # expired() ended them in the scheduler (or drains them)
        expired = pd.expired(sched)
        pd.retry(sched)
    else:
        expired = pd.expired()
    for rid, why in expired:
        _fail(worker, rid, why, 504, abort=not isinstance(pd, DecodeRooms))
    return BUSY_POLL_MS if pd.busy() else None


def send_pages(
    worker: Any, batch: Batch, result: StepResult, lps: dict[str, TokenLogprob]
) -> set[str]:
    """Prefill role, after the forward: pages out; returns the rids whose transfer failed (their
    errors are sent; their tokens must not be)."""
    pd = worker.pd
    if not isinstance(pd, PrefillRooms) or not pd.running:
        return set()
    failed = pd.send_pages(batch, result, worker.scheduler, lps)
    for rid, why in failed.items():
        worker.push.send_pyobj(error_out(rid, why, 502))
        worker.live.pop(rid, None)
    return set(failed)


def forget(worker: Any, rid: str) -> bool:
    """A request aborted or stopped by its client: its room goes (a decode engine tells the
    prefill side to send nothing). True if the rooms keep its slots a while (the caller must
    not free them): pages may still be on their way into them."""
    pd = worker.pd
    if isinstance(pd, DecodeRooms):
        return pd.cancel(rid, worker.scheduler)
    pd.abandon(rid)
    return False


def _fail(worker: Any, rid: str, why: str, code: int, abort: bool = True) -> None:
    if abort:
        worker.scheduler.abort(rid)
    if worker.live.pop(rid, None) is not None:
        worker.push.send_pyobj(error_out(rid, why, code))
