"""Prefill/decode disaggregation inside the scheduler process: the rooms each role keeps.

A room pairs one request's two halves. The decode engine reserves slots for it and sends
``KVDest`` (where the pages go) to the prefill engine's scheduler; the prefill engine admits the
request once both it and the KVDest are there, and right after the forward that completes its
prompt hands the pages to its sender thread (engine/pd_sender.py), which writes them
(kvstore/pd_transfer.py); then it answers ``KVDone`` with the first token.
Both sides wait a bounded time, then end the request with an error; nothing is kept after.
The peers reach each other's scheduler on a TCP endpoint bound beside its own IPC one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.engine.messages import ErrorOut, GenerateReq, KVCancel, KVDest, KVDone
from radixserve.engine.pd_sender import PageSender, Send
from radixserve.kvstore.pd_transfer import MooncakeTransfer, PoolLayout
from radixserve.sched.batch import Batch, StepResult, TokenLogprob
from radixserve.sched.request import Req, TokenOutput
from radixserve.sched.scheduler import Scheduler

log = logging.getLogger("radixserve.pd")
Clock = Callable[[], float]


def pool_layout(runner: Any) -> PoolLayout:
    """The runner's KV pool as the transfer sees it (model/kv_pool.py's one tensor)."""
    kv = getattr(getattr(runner, "kv", None), "kv", None)
    if kv is None or not kv.is_contiguous():
        raise ValueError("--disaggregation-mode needs a real model's KV pool (not --sim)")
    layers, _, slots, heads, dim = kv.shape
    return PoolLayout(kv.data_ptr(), layers, slots, heads * dim * kv.element_size())


@dataclass(slots=True)
class _Peers:
    """PUSH sockets to other engines' schedulers, one per endpoint, made on first use."""

    ctx: zmq.Context
    socks: dict[str, zmq.Socket] = field(default_factory=dict)

    def send(self, endpoint: str, msg: Any) -> None:
        sock = self.socks.get(endpoint)
        if sock is None:
            sock = self.socks[endpoint] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(endpoint)
        try:
            sock.send_pyobj(msg, zmq.NOBLOCK)
        except zmq.Again:  # a peer that is gone: its side times out
            log.warning("could not send %s to %s", type(msg).__name__, endpoint)


class PDRole:
    """What both roles share: the transfer engine on this pool, the TCP endpoint peers send
    to, the wait bound."""

    def __init__(self, config: Any, runner: Any, pull: zmq.Socket, clock: Clock) -> None:
        self.config, self.clock = config, clock
        host = config.disaggregation_host
        self.transfer = MooncakeTransfer(host, pool_layout(runner), config.disaggregation_ib_device)
        port = pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.peers = _Peers(zmq.Context.instance())
        self.timeout = config.disaggregation_waiting_timeout

    def info(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.config.disaggregation_mode,
                "rank_ip": self.config.disaggregation_host,
                "rank_port": int(self.endpoint.rsplit(":", 1)[1]),
                "transfer_session": self.transfer.session}  # fmt: skip

    def busy(self) -> bool:
        """Whether a room waits on something (the loop then polls often, to keep bounds)."""
        raise NotImplementedError


class PrefillRooms(PDRole):
    """Prefill role: a request waits for its room's KVDest (or a KVDest for its request), then
    runs to its first token; its pages go to the decode engine before that token is out."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.held: dict[int, tuple[Req, float]] = {}  # request here, KVDest not yet
        self.dests: dict[int, tuple[KVDest, float]] = {}  # KVDest here, request not yet
        self.running: dict[str, tuple[int, KVDest]] = {}  # rid -> room, admitted
        self.rooms: dict[int, str] = {}  # room -> rid, for every request here with a room
        self.sender = PageSender(self.transfer, self.endpoint)  # the writes, off the loop

    def busy(self) -> bool:
        return bool(self.held or self.dests)

    def counts(self) -> dict[str, int]:
        return {"held": len(self.held), "dests": len(self.dests), "running": len(self.running),
                "rooms": len(self.rooms), "sending": len(self.sender.inflight)}  # fmt: skip

    def admit(self, msg: GenerateReq, req: Req) -> Req | None:
        """A new request: ValueError if its room is taken; the Req to queue now (its
        destination is known), or None (held until it is)."""
        room = msg.bootstrap_room
        if room in self.rooms:
            raise ValueError(f"bootstrap_room {room} is already in flight on this engine")
        # the prefill computes the prompt and samples the first token; decoding is elsewhere
        req.sampling = dataclasses.replace(req.sampling, max_new_tokens=1, min_new_tokens=0)
        self.rooms[room] = req.rid
        got = self.dests.pop(room, None)
        if got is None:
            self.held[room] = (req, self.clock() + self.timeout)
            return None
        self.running[req.rid] = (room, got[0])
        return req

    def on_dest(self, msg: KVDest) -> Req | None:
        """A decode engine registered a room: the held request to queue now, if any."""
        held = self.held.pop(msg.room, None)
        if held is None:
            if msg.room in self.rooms:  # its request already runs: a second registration
                self.peers.send(msg.reply, KVDone(msg.room, None, "room already registered"))
            else:
                self.dests[msg.room] = (msg, self.clock() + self.timeout)
            return None
        self.running[held[0].rid] = (msg.room, msg)
        return held[0]

    def on_cancel(self, msg: KVCancel) -> str | None:
        """The decode side gave up on a room: the rid to abort here, if it is still here. The
        decode engine holds the room's slots until it hears that no page will come: told so
        now, unless the pages went already (their KVDone, sent earlier, tells it)."""
        got = self.dests.pop(msg.room, None)
        dest = got[0] if got is not None else None
        rid = self.rooms.get(msg.room)
        if rid is not None:
            dest = dest or self.running.get(rid, (None, None))[1]
            self.forget(rid)
        if dest is not None:
            self.peers.send(dest.reply, KVDone(msg.room, None, "cancelled by the decode engine"))
        return rid

    def expired(self) -> list[tuple[str, str]]:
        """(rid, why) of requests whose decode engine never registered; stale KVDests go."""
        now = self.clock()
        for room, (dest, until) in list(self.dests.items()):
            if until <= now:
                del self.dests[room]
                self.peers.send(
                    dest.reply,
                    KVDone(
                        room, None, f"the prefill engine got no request for bootstrap_room {room}"
                    ),
                )
        out = []
        for room, (req, until) in list(self.held.items()):
            if until <= now:
                self.forget(req.rid)
                out.append((req.rid, f"no decode engine registered bootstrap_room {room} "
                            f"within {self.timeout:g} s"))  # fmt: skip
        return out

    def abandon(self, rid: str) -> None:
        """The client went away: a decode engine waiting on the pages hears so now."""
        got = self.running.get(rid)
        if got is not None:
            room, dest = got
            self.peers.send(dest.reply, KVDone(room, None, f"the prefill request of "
                                               f"bootstrap_room {room} was aborted"))  # fmt: skip
        self.forget(rid)

    def forget(self, rid: str) -> None:
        room = next((r for r, x in self.rooms.items() if x == rid), None)
        if room is not None:
            del self.rooms[room]
            self.held.pop(room, None)
        self.running.pop(rid, None)

    def collect(
        self, batch: Batch, result: StepResult, sched: Scheduler, lps: dict[str, TokenLogprob]
    ) -> dict[str, tuple[Send, list[int]]]:
        """After the forward that completed prompts of rooms, before ``on_output``: their
        writes (rid -> what to answer, the slots to read), whose slots stay held after the
        request ends until ``release_held``. Their rooms are done here."""
        sends = {}
        for entry, token in zip(batch.entries, result.next_token_ids):
            got = self.running.get(entry.rid) if entry.sample else None
            if got is None:
                continue
            room, dest = got
            src = list(sched.slot_table.slots(entry.rid)[dest.skip : len(entry.prompt_ids)])
            sends[entry.rid] = (Send(room, dest, token, lps.get(entry.rid)), src)
            sched.hold(entry.rid)
            self.forget(entry.rid)
        return sends


class DecodeRooms(PDRole):
    """Decode role: reserve the whole generation's slots, send KVDest, wait for KVDone; a
    request that cannot be reserved yet waits (bounded) for room."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pending: dict[str, tuple[GenerateReq, Req, float]] = {}  # not reserved yet
        self.waiting: dict[int, tuple[str, str, float]] = {}  # room -> rid, prefill, until
        # room -> rid, until: ended here, its slots kept until the prefill engine says that no
        # page is on its way, so a late write never lands in slots another request took since
        self.draining: dict[int, tuple[str, float]] = {}
        # prompt tokens whose KV was asked of a prefill engine, or found in this engine's tree
        self.sent = {"prompt_tokens_sent": 0, "prompt_tokens_reused": 0}

    def busy(self) -> bool:
        return bool(self.pending or self.waiting or self.draining)

    def counts(self) -> dict[str, int]:
        return {"pending": len(self.pending), "waiting": len(self.waiting),
                "draining": len(self.draining)}  # fmt: skip

    def admit(self, msg: GenerateReq, req: Req, sched: Scheduler) -> None:
        """ValueError if the request can never run here or its room is taken."""
        room = msg.bootstrap_room
        queued = (m.bootstrap_room for m, _, _ in self.pending.values())
        if room in self.waiting or room in self.draining or room in queued:
            raise ValueError(f"bootstrap_room {room} is already in flight on this engine")
        until = self.clock() + self.timeout
        if not self._reserve(msg, req, sched, until):
            self.pending[req.rid] = (msg, req, until)

    def _reserve(self, msg: GenerateReq, req: Req, sched: Scheduler, until: float) -> bool:
        if not sched.reserve(req):
            return False
        room = msg.bootstrap_room
        assert room is not None and msg.prefill_endpoint is not None
        self.waiting[room] = (req.rid, msg.prefill_endpoint, until)
        skip = req.prefix_len  # what this engine's tree held of the prompt: not sent again
        slots = list(sched.slot_table.slots(req.rid)[skip:])
        self.sent["prompt_tokens_sent"] += len(slots)
        self.sent["prompt_tokens_reused"] += skip
        dest = KVDest(room, self.transfer.session, self.transfer.layout, slots, self.endpoint,
                      skip)  # fmt: skip
        self.peers.send(msg.prefill_endpoint, dest)
        return True

    def retry(self, sched: Scheduler) -> None:
        """Reserve the pending requests that fit now, in arrival order."""
        for rid, (msg, req, until) in list(self.pending.items()):
            if not self._reserve(msg, req, sched, until):
                return
            del self.pending[rid]

    def on_done(self, msg: KVDone, sched: Scheduler) -> tuple[str, TokenOutput | str] | None:
        """Pages landed (the rid and its first token's output) or never will (rid, why);
        None for a room not waiting here, whose message is refused."""
        drained = self.draining.pop(msg.room, None)
        if drained is not None:  # no page will land now: the slots are free to reuse
            sched.abort(drained[0])
            return None
        got = self.waiting.pop(msg.room, None)
        if got is None:
            log.warning("refused KVDone for bootstrap_room %s: no request waits on it", msg.room)
            return None
        rid = got[0]
        if msg.error is not None or msg.first_token is None:
            sched.abort(rid)
            return rid, msg.error or "the prefill engine sent no first token"
        return rid, sched.receive(rid, msg.first_token)

    def expired(self, sched: Scheduler) -> list[tuple[str, str]]:
        now = self.clock()
        out = []
        for rid, (msg, _, until) in list(self.pending.items()):
            if until <= now:
                del self.pending[rid]
                out.append((rid, f"no KV room for bootstrap_room {msg.bootstrap_room} within "
                            f"{self.timeout:g} s"))  # fmt: skip
        for room, (rid, _, until) in list(self.waiting.items()):
            if until <= now:
                self.cancel(rid, sched)
                out.append((rid, f"the KV pages of bootstrap_room {room} did not arrive "
                            f"within {self.timeout:g} s"))  # fmt: skip
        for room, (rid, until) in list(self.draining.items()):
            if until <= now:  # no answer from a prefill engine that is gone: none will write
                del self.draining[room]
                sched.abort(rid)
        return out

    def cancel(self, rid: str, sched: Scheduler) -> bool:
        """The request ended here (aborted, timed out): tell its prefill side. True if its
        slots stay held (pages may be on their way) until the prefill side answers or the
        bound passes; else it is freed now."""
        self.pending.pop(rid, None)
        room = next((r for r, x in self.waiting.items() if x[0] == rid), None)
        if room is None:
            sched.abort(rid)
            return False
        _, prefill, _ = self.waiting.pop(room)
        self.peers.send(prefill, KVCancel(room))
        self.draining[room] = (rid, self.clock() + self.timeout)
        return True


def make_role(config: Any, runner: Any, pull: zmq.Socket) -> PDRole | None:
    """The role's rooms for ``config`` (a DisaggConfig), or None for an aggregated engine."""
    if not config.enabled:
        return None
    cls = PrefillRooms if config.disaggregation_mode == "prefill" else DecodeRooms
    return cls(config, runner, pull, time.monotonic)


def error_out(rid: str, why: str, code: int) -> ErrorOut:
    return ErrorOut(rid, why, code, "bootstrap_room")
