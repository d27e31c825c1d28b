"""RunningSet: the running requests and the KV they may still need to decode.

It keeps the decoding requests in admission order, the one being prefilled in chunks, their
routing keys, and SGLang's adaptive new-token ratio, which sizes the KV reserved for them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from radixserve.config import SchedulerConfig
from radixserve.sched.adder import reserved_new_tokens
from radixserve.sched.request import Req

# After a retraction the reserved share is re-estimated as if every running request will
# decode this many more steps (SGLang's retract_decode_steps).
RETRACT_DECODE_STEPS = 20
CURVE_STEPS = 10_000  # the most decode steps of the new-token ratio's decay worked out ahead


def retract_order(req: Req) -> tuple[int, int, int]:
    """Retraction victims first: fewest generated tokens (least work lost), then the longest
    prompt (frees the most), then the newest."""
    return (req.num_generated, -len(req.input_ids), -req.seq)


class RunningSet:
    """The new-token ratio starts at ``new_token_ratio``, decays by ``new_token_ratio_decay``
    per decode step to ``min_new_token_ratio`` (requests usually stop before max_new_tokens,
    so less and less is reserved), and is reset up on a retraction (it reserved too little)
    and when the engine goes idle."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.decoding: dict[str, Req] = {}  # admission order: the decode batch's order
        self.chunked: Req | None = None
        self.keys: Counter[str] = Counter()  # routing key -> running requests
        self.ratio = config.new_token_ratio
        self._memo: tuple | None = None  # the decay curve (see ``decay``) and its settings

    def __len__(self) -> int:
        return len(self.decoding) + (self.chunked is not None)

    def all(self) -> list[Req]:
        return [*self.decoding.values(), *([self.chunked] if self.chunked else [])]

    def enter(self, req: Req) -> None:
        if req.routing_key is not None:
            self.keys[req.routing_key] += 1

    def leave(self, req: Req) -> None:
        if self.chunked is req:
            self.chunked = None
        else:
            self.decoding.pop(req.rid, None)
        if req.routing_key is not None:
            self.keys[req.routing_key] -= 1
            if not self.keys[req.routing_key]:
                del self.keys[req.routing_key]

    def reserved(self) -> float:
        """KV the decoding requests may still need, as the ratio estimates it."""
        return sum(reserved_new_tokens(r) for r in self.decoding.values()) * self.ratio

    def retraction_order(self) -> list[Req]:
        order = sorted(self.decoding.values(), key=retract_order)
        return order + [self.chunked] if self.chunked is not None else order

    def pick_victims(
        self,
        req: Req,
        threshold: int,
        taken: list[Req],
        short_kv: float,
        short_slots: int,
        held_by: Callable[[Req], int],
    ) -> tuple[list[Req], float]:
        """Decoding requests to preempt for ``req``: priority lower than its by more than
        ``threshold``, lowest then newest first, until their KV (``held_by`` plus their
        reservation) and slots cover what ``req`` lacks. ([], 0) if they cannot."""
        cands = [r for r in self.decoding.values() if req.priority - r.priority > threshold]
        cands = [r for r in sorted(cands, key=lambda r: (r.priority, -r.seq)) if r not in taken]
        picked: list[Req] = []
        freed = 0.0
        for r in cands:
            if freed >= short_kv and len(picked) >= short_slots:
                break
            picked.append(r)
            freed += held_by(r) + reserved_new_tokens(r) * self.ratio
        if freed < short_kv or len(picked) < short_slots:
            return [], 0.0
        return picked, freed

    def decay(self, steps: int = 1) -> None:
        """``steps`` decode steps' decay, one subtraction at a time (as many single steps do).
        The ratios from ``new_token_ratio`` down are worked out once (``_curve``): a ratio on
        that curve moves ``steps`` places along it, as the subtractions would take it."""
        curve, place, floored = self._curve()
        i = place.get(self.ratio)
        if i is not None and (i + steps < len(curve) or floored):
            self.ratio = curve[min(i + steps, len(curve) - 1)]
            return
        self.ratio = _decayed(self.ratio, steps, self.config)

    def _curve(self) -> tuple[list[float], dict[float, int], bool]:
        """The ratios from ``new_token_ratio`` on, a decode step apart (at most CURVE_STEPS),
        their places, and whether the last is the floor (where the ratio then stays)."""
        cfg = self.config
        key = (cfg.new_token_ratio, cfg.new_token_ratio_decay, cfg.min_new_token_ratio)
        if self._memo is None or self._memo[0] != key:
            curve = [cfg.new_token_ratio]
            while len(curve) < CURVE_STEPS and curve[-1] != _decayed(curve[-1], 1, cfg):
                curve.append(_decayed(curve[-1], 1, cfg))
            floored = curve[-1] == _decayed(curve[-1], 1, cfg)
            self._memo = (key, curve, {r: i for i, r in enumerate(curve)}, floored)
        return self._memo[1:]

    def reset_ratio(self) -> None:
        self.ratio = self.config.new_token_ratio

    def on_retract(self) -> None:
        reqs = self.decoding.values()
        done = sum(r.num_generated for r in reqs) + RETRACT_DECODE_STEPS * len(reqs)
        est = done / max(1, sum(r.sampling.max_new_tokens for r in reqs))
        self.ratio = min(1.0, max(est, self.config.new_token_ratio))


def _decayed(ratio: float, steps: int, cfg: SchedulerConfig) -> float:
    """``ratio`` after ``steps`` decode steps' decay, one subtraction at a time."""
    step, low = cfg.new_token_ratio_decay, cfg.min_new_token_ratio
    for _ in range(steps):
        if ratio <= low and step >= 0:  # at the floor it stays there
            return max(ratio, low)
        ratio = max(ratio - step, low)
    return ratio
