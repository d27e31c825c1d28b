"""The scheduler's side of disaggregated serving: on a decode engine, slots reserved for a
prompt a prefill engine computes, then its KV received; on a prefill engine, the slots of
finished requests held while a transfer reads them. Mixed into ``Scheduler``."""

from __future__ import annotations

from radixserve.sched.kv import KVManager
from radixserve.sched.receive import fits
from radixserve.sched.request import Req, ReqState, TokenOutput
from radixserve.sched.validate import check_request


class DisaggRole:
    """Reserve / receive (decode role) and hold / release_held (prefill role)."""

    kv: KVManager
    receiving: dict[str, Req]
    held: dict[str, Req]

    # -- the decode role: prompts computed by a prefill engine -------------------------------
    def reserve(self, req: Req) -> bool:
        """Slots for the KV of ``req``'s prompt, which a prefill engine computes and sends;
        ``receive`` once it has landed. False, keeping nothing: no room now for it to decode
        to its end beside the others (sched/receive.py); ValueError: it can never run here."""
        check_request(req, self.context_length, self.kv.total, self.kv.page)
        if req.rid in self._reqs:  # max_new_tokens 1: it ends on the first token received
            raise ValueError(f"request id {req.rid!r} is already in use")
        here = [*self.running.decoding.values(), *self.receiving.values()]
        if len(here) >= self.config.max_running_requests or not fits(self.kv, here, req):
            return False
        self._reuse_prefix(req)
        self.kv.extend(req, len(req.input_ids) - req.kv_len)
        req.kv_len, req.state = len(req.input_ids), ReqState.RUNNING
        self._seq += 1
        req.seq = self._seq
        self._reqs[req.rid] = self.receiving[req.rid] = req
        self.running.enter(req)
        return True

    def _reuse_prefix(self, req: Req) -> None:
        """Open ``req`` on the longest prefix of its prompt this engine's tree holds (pages it
        received, or decoded, for earlier requests), locked: only the rest is sent to it. The
        whole prompt may match, as nothing is computed here for it."""
        m = self.kv.cache.match_prefix(req.input_ids, req.namespace) if self.kv.enabled else None
        hit = m is not None and m.length > 0
        req.match_node = m.last_node if hit else None
        req.match_len = req.prefix_len = m.length if hit else 0
        self.kv.lock(req.match_node)
        self.kv.open(req)

    def hold(self, rid: str) -> None:
        """Prefill role: when ``rid`` ends, keep its slots (a transfer reads them) until
        ``release_held``; only then is its prompt cached and the rest freed."""
        self._holding.add(rid)

    def release_held(self, rid: str) -> None:
        self._holding.discard(rid)
        req = self.held.pop(rid, None)
        if req is not None:
            self.kv.release(req, keep=req.state is ReqState.FINISHED)

    def receive(self, rid: str, first_token: int) -> TokenOutput:
        """The prompt's KV has landed in the reserved slots, with the first token the prefill
        engine sampled: the request decodes from the next step (or ends, on a stop token)."""
        req = self.receiving.pop(rid)
        self.running.decoding[rid] = req
        return self._append(req, first_token, was_prefill=False)
