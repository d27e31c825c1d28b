"""PrefillAdder: which waiting requests join one prefill step, and how much of each.

Pure bookkeeping over four budgets (prefill tokens, chunk tokens, running slots, KV); the
scheduler locks prefixes and allocates slots for what it admits.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from radixserve.config import SchedulerConfig
from radixserve.sched.request import Req

# Cap on the new tokens a request is assumed to still generate when KV is reserved for it
# (SGLang's CLIP_MAX_NEW_TOKENS): a max_new_tokens of 32k would otherwise block admission for
# a generation that usually stops far earlier. It bounds the estimate, never the generation.
CLIP_MAX_NEW_TOKENS = 4096


class AddResult(enum.Enum):
    ADDED = "added"
    SKIPPED = "skipped"  # shares an uncached prefix with a request admitted this step
    NO_TOKEN = "no_token"  # the KV budget is spent: stop the pass
    NO_SLOT = "no_slot"  # max_running_requests reached: stop the pass
    FULL = "full"  # the step's prefill token budget is spent: stop the pass


@dataclass(slots=True)
class Admission:
    """``req`` computes fill positions ``start .. start + extend_len - 1`` this step."""

    req: Req
    start: int
    extend_len: int

    @property
    def end(self) -> int:
        return self.start + self.extend_len

    @property
    def completes(self) -> bool:
        return self.end == self.req.fill_len


def reserved_new_tokens(req: Req) -> int:
    """KV a running request may still need for decoding, before the new-token ratio."""
    return min(req.sampling.max_new_tokens - req.num_generated, CLIP_MAX_NEW_TOKENS)


class PrefillAdder:
    """Admission for one prefill step.

    Budgets: ``max_prefill_tokens`` uncached tokens per step (cached ones are free; without
    chunking the first request may exceed it, or it could never run), ``chunked_prefill_size``
    tokens per step above which a prompt is cut into page-aligned chunks (one chunked request
    at a time), ``max_running_requests``, and KV: ``kv_room()`` (free + evictable slots, read
    live so a prefix locked during the pass stops counting) minus ``reserved`` (what running
    requests may still decode, times the new-token ratio) minus what this step promised (the
    admitted prompts in whole pages plus their clipped max_new_tokens).

    In-batch prefix dedupe (cache-aware policies): a request whose next ``dedupe_tokens``
    uncached tokens equal those of a request admitted this step, at the same tree node, is
    skipped; once that one is cached it matches the shared part and costs it nothing.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        page_size: int,
        kv_room: Callable[[], int],
        reserved: float,
        num_running: int,
        dedupe: bool,
    ) -> None:
        self.page = page_size
        self.kv_room = kv_room
        self.offset = reserved
        self.rem_input = config.max_prefill_tokens
        self.rem_chunk = config.chunked_prefill_size if config.chunked_prefill_size > 0 else None
        self.rem_slots = config.max_running_requests - num_running
        self.dedupe_tokens = config.in_batch_prefix_threshold if dedupe else 0
        self.admitted: list[Admission] = []
        self.chunked: Admission | None = None  # the admission that stops short of its fill
        self._prefixes: set[tuple[Hashable, tuple[int, ...]]] = set()

    def _pages(self, n: int) -> int:
        return -(-n // self.page) * self.page

    def _limit(self) -> int:
        return self.rem_input if self.rem_chunk is None else min(self.rem_input, self.rem_chunk)

    def kv_short(self, req: Req, start: int) -> float:
        """How many KV slots admitting ``req`` from ``start`` lacks (<= 0: it fits)."""
        need = self._pages(req.fill_len - start) + reserved_new_tokens(req)
        return need - (self.kv_room() - self.offset)

    def credit(self, tokens: float, slots: int) -> None:
        """Give back budget (a preempted request's KV and running slot)."""
        self.offset -= tokens
        self.rem_slots += slots

    def add_decodes(self, num: int) -> None:
        """Mixed steps: running decodes take one token each of the step's chunk budget."""
        self.rem_input -= num
        if self.rem_chunk is not None:
            self.rem_chunk -= num

    def add_chunk(self, req: Req, node: Hashable) -> Admission:
        """The next chunk of the request being prefilled in chunks: it always goes first and
        always makes progress (the scheduler made the KV room for it)."""
        start = req.kv_len
        n = self._fit(req.fill_len - start, chunking=True)
        adm = self._commit(req, start, max(n, min(self.page, req.fill_len - start)))
        self._remember(req, node, start)
        return adm

    def add(self, req: Req) -> AddResult:
        """Offer a waiting request whose cached prefix (``req.prefix_len``) is locked."""
        if self.rem_slots <= 0:
            return AddResult.NO_SLOT
        if self._is_duplicate(req):
            return AddResult.SKIPPED
        if self.kv_short(req, req.prefix_len) > 0:
            return AddResult.NO_TOKEN
        # what only the host tier holds is loaded, not computed: it takes KV room but none of
        # the step's token budget, so a chunked prefill loads the whole host match at once
        # (at least one token is still computed). ``host_len`` is the index's hint: should the
        # load bring fewer (no device room), this one step computes the rest, over its budget
        # but never wrong.
        loaded = max(0, min(req.host_len, req.fill_len - req.prefix_len - 1))
        n = self._fit(req.fill_len - req.prefix_len - loaded, chunking=self.chunked is None)
        if n <= 0:
            return AddResult.FULL
        self._commit(req, req.prefix_len, n, loaded)
        self._remember(req, req.match_node, req.match_len)
        return AddResult.ADDED

    def _fit(self, extend: int, chunking: bool) -> int:
        """Tokens of ``extend`` this step can take (0: none)."""
        limit = self._limit()
        if extend <= limit:
            return extend
        if self.rem_chunk is None:
            return extend if not self.admitted else 0
        return limit - limit % self.page if chunking else 0

    def _commit(self, req: Req, start: int, n: int, loaded: int = 0) -> Admission:
        """Admit ``loaded`` tokens to bring from the host tier and ``n`` to compute."""
        adm = Admission(req, start, loaded + n)
        rest = req.fill_len - adm.end  # the rest of a chunked prompt is promised too
        self.offset += self._pages(loaded + n) + rest + reserved_new_tokens(req)
        self.rem_input -= n
        if self.rem_chunk is not None:
            self.rem_chunk -= n
        self.rem_slots -= 1
        self.admitted.append(adm)
        if not adm.completes:
            self.chunked = adm
        return adm

    def _dedupe_key(self, req: Req, node: Hashable, at: int) -> tuple | None:
        if not self.dedupe_tokens or at + self.dedupe_tokens > req.fill_len:
            return None
        return (node, tuple(req.fill_slice(at, at + self.dedupe_tokens)))

    def _is_duplicate(self, req: Req) -> bool:
        key = self._dedupe_key(req, req.match_node, req.match_len)
        return key is not None and key in self._prefixes

    def _remember(self, req: Req, node: Hashable, at: int) -> None:
        key = self._dedupe_key(req, node, at)
        if key is not None:
            self._prefixes.add(key)
