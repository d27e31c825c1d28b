"""The prefill role's page writes, off the scheduler loop: a thread of its own writes each
prompt's KV rows to its decode engine and tells the scheduler (a ``KVSent`` on its own TCP
endpoint, which wakes its loop) so it releases the slots and answers both sides.

The scheduler keeps the request's slots held (``Scheduler.hold``) while the thread reads them.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import zmq

from radixserve.engine.messages import KVDest, KVSent
from radixserve.kvstore.pd_transfer import MooncakeTransfer
from radixserve.sched.batch import TokenLogprob
from radixserve.sched.request import TokenOutput


@dataclass(slots=True)
class Send:
    """One room's write in flight and what is answered once it is done."""

    room: int
    dest: KVDest
    token: int
    logprob: TokenLogprob | None
    out: TokenOutput | None = None  # the first token's output, held back until then


class PageSender:
    def __init__(self, transfer: MooncakeTransfer, endpoint: str) -> None:
        self.transfer, self.endpoint = transfer, endpoint
        self.inflight: dict[str, Send] = {}
        self._jobs: queue.SimpleQueue[tuple[str, list[int], KVDest] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pd-sender", daemon=True)
        self._thread.start()

    def submit(self, rid: str, send: Send, src: list[int]) -> None:
        self.inflight[rid] = send
        self._jobs.put((rid, src, send.dest))

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        while (job := self._jobs.get()) is not None:
            rid, src, dest = job
            try:
                self.transfer.write(dest.session, dest.layout, src, dest.slots[: len(src)])
                error = None
            except (RuntimeError, ValueError) as e:
                error = str(e)
            sock.send_pyobj(KVSent(rid, error))
        sock.close()

    def done(self, msg: KVSent) -> Send | None:
        return self.inflight.pop(msg.rid, None)

    def close(self) -> None:
        self._jobs.put(None)
