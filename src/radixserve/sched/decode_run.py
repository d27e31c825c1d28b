"""Runs of pure decode steps applied at once: how many steps from here can change nothing but
the decoding requests' KV and outputs, and applying them exactly as one step at a time would.

A discrete-event simulator spends most of its time on single-token decode steps of long
outputs; when nothing else can happen between them it advances a whole run in one event. A run
may evict from the tree (a full pool): ``RunEvictions`` makes each step's eviction, the one
``step()`` would make, when the caller says that step has begun, so that anyone who reads the
tree meanwhile finds it as single steps would have left it.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.sched.kv import KVManager
from radixserve.sched.running import RunningSet


def run_length(
    running: RunningSet, num_waiting: int, kv: KVManager, eos_token_ids: frozenset[int]
) -> int:
    """Decode steps that ``step()`` would take back to back, each on the same requests,
    without retraction, up to and including the first step that finishes a request (at its
    max_new_tokens: ``apply_run``'s caller ends it). 0 when anything else is waiting, being
    prefilled or may stop early (a stop token, or EOS without ``ignore_eos``)."""
    if running.chunked is not None or num_waiting or not running.decoding:
        return 0
    left = None
    for req in running.decoding.values():
        sp = req.sampling
        if sp.stop_token_ids or (eos_token_ids and not sp.ignore_eos):
            return 0
        n = sp.max_new_tokens - len(req.output_ids)
        left = n if left is None or n < left else left
    # a step retracts only when the free slots and all that eviction can free fall short of
    # its new pages, so the run is as long as the pages of its steps fit in kv.room()
    hi = left  # type: ignore[assignment]
    if kv.allocator.available() >= len(running.decoding) * (hi + kv.page):
        return max(hi, 0)  # free slots alone hold every page the run can take
    rooms, room = page_rooms(running, kv), kv.room()
    if hi <= 0 or run_need(rooms, kv.page, hi) <= room:
        return max(hi, 0)
    lo = 0  # run_need(0) == 0: fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run_need(rooms, kv.page, mid) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def page_rooms(running: RunningSet, kv: KVManager) -> list[int]:
    """Positions left in each decoding request's last page of its own slots."""
    page, table = kv.page, kv.table
    if page == 1:
        return [0] * len(running.decoding)
    return [(len(table.slots(r)) - table.owned_from(r)) * -1 % page for r in running.decoding]


def run_need(rooms: Sequence[int], page: int, steps: int) -> int:
    """Slots that ``steps`` decode steps take from the allocator, the requests having
    ``rooms[i]`` positions left in their last page (as ``RequestSlotTable.extend_cost``)."""
    if page == 1:
        return len(rooms) * steps
    return sum((steps - r + page - 1) // page for r in rooms if steps > r) * page


class RunEvictions:
    """The evictions of a booked run. Step ``s`` of single steps evicts, before its new pages
    are taken, what the free slots lack for them; the run takes every page at its end, so
    (nothing else allocating meanwhile) step ``s`` evicts exactly when the pages of steps
    1..s exceed the free slots, and the same amount: ``kv.ensure_free(run_need(s))``."""

    def __init__(self, running: RunningSet, kv: KVManager, steps: int) -> None:
        self.kv, self.steps = kv, steps
        self.rooms = page_rooms(running, kv)
        self.begun = 0  # steps whose evictions are made

    def next_step(self) -> int | None:
        """The first step not begun that will evict (None: none will)."""
        free, rooms, page = self.kv.allocator.available(), self.rooms, self.kv.page
        lo, hi = self.begun, self.steps  # run_need(lo) <= free: the steps begun have evicted
        if len(rooms) == 1:  # one request: its step past room + the free pages takes a page
            first = rooms[0] + free // page * page + 1
            if first > lo:
                return first if first <= hi else None
        if run_need(rooms, page, hi) <= free:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if run_need(rooms, page, mid) <= free:
                lo = mid
            else:
                hi = mid
        return hi

    def begin(self, steps: int) -> int:
        """Steps up to ``steps`` have begun: make their evictions, in step order; returns how
        many steps evicted."""
        steps, made = min(steps, self.steps), 0
        rooms, page, alloc = self.rooms, self.kv.page, self.kv.allocator
        # run_need grows with the steps: if the begun ones fit the free slots, none of them
        # evicts, and the search for the next that does (next_step) can wait for its caller
        while run_need(rooms, page, steps) > alloc.available():
            s = self.next_step()
            assert s is not None and s <= steps
            ok = self.kv.ensure_free(run_need(rooms, page, s))
            assert ok, "a decode run was booked past what eviction can free"
            self.begun, made = s, made + 1
        self.begun = max(self.begun, steps)
        return made


def apply_run(running: RunningSet, kv: KVManager, tokens: Sequence[Sequence[int]]) -> int:
    """Apply ``len(tokens[0])`` decode steps: ``tokens[i]`` are the next tokens of the i-th
    decoding request (``running.decoding`` order). Returns the number of steps."""
    steps = len(tokens[0])
    decoding = running.decoding
    if len(tokens) != len(decoding) or any(len(toks) != steps for toks in tokens):
        raise ValueError("every decoding request needs the same number of tokens")
    kv.table.extend_all(decoding, steps)
    for req, toks in zip(decoding.values(), tokens):
        req.kv_len += steps
        req.output_ids.extend(toks)
    running.decay(steps)
    return steps
