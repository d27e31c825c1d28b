"""The scheduler process's loop hooks for a prefill or decode engine (engine/pd_rooms.py keeps
the rooms): a request with a room in, the peers' messages, the wait bounds, the pages sent
after a forward. An aggregated engine calls none of these."""

from __future__ import annotations

from typing import Any

from radixserve.engine.messages import GenerateReq, KVCancel, KVDest, KVDone, KVSent, TokenBatch
from radixserve.engine.pd_rooms import DecodeRooms, PrefillRooms, error_out
from radixserve.engine.pd_sender import Send
from radixserve.sched.batch import Batch, StepResult, TokenLogprob
from radixserve.sched.request import Req, TokenOutput

PEER_MESSAGES = (KVDest, KVDone, KVCancel, KVSent)
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
    elif isinstance(msg, KVSent) and isinstance(pd, PrefillRooms):
        _sent(worker, pd, msg)
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
) -> dict[str, tuple[Send, list[int]]]:
    """Prefill role, after the forward and before ``on_output``: the writes to start (their
    requests' slots stay held when they end)."""
    pd = worker.pd
    if not isinstance(pd, PrefillRooms) or not pd.running:
        return {}
    return pd.collect(batch, result, worker.scheduler, lps)


def start_sends(
    worker: Any, sends: dict[str, tuple[Send, list[int]]], outs: list[TokenOutput]
) -> list[TokenOutput]:
    """After ``on_output``: the writes go to the sender thread; the first tokens of their
    requests wait for them (returns the outputs to send now)."""
    now = []
    for out in outs:
        got = sends.get(out.rid)
        if got is None:
            now.append(out)
        else:
            got[0].out = out
    for rid, (send, src) in sends.items():
        worker.pd.sender.submit(rid, send, src)
    return now


def _sent(worker: Any, pd: PrefillRooms, msg: KVSent) -> None:
    """A write is done: the slots go back, the decode engine hears, then the client."""
    worker.scheduler.release_held(msg.rid)
    send = pd.sender.done(msg)
    if send is None:
        return
    if msg.error is not None:
        why = f"KV transfer for bootstrap_room {send.room} failed: {msg.error}"
        pd.peers.send(send.dest.reply, KVDone(send.room, None, why))
        if worker.live.pop(msg.rid, None) is not None:
            worker.push.send_pyobj(error_out(msg.rid, why, 502))
        return
    pd.peers.send(send.dest.reply, KVDone(send.room, send.token, None, send.logprob))
    token = worker._token_out(send.out, send.logprob) if send.out is not None else None
    if token is not None:
        worker.push.send_pyobj(TokenBatch([token]))


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
