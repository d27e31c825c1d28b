"""The load-to-prefill ratios an engine reports to a kv_aware router, as running means of its
own timings: seconds to bring a token's KV from the host tier, and from the storage tier, into
the device pool over seconds to prefill one token."""

# What is timed (engine/scheduler_proc.py, engine/storage_tier.py): every forward that prefills
# (its tokens: prefill chunks and, with mixed chunks, the decodes beside them), every step's
# host -> device page copies (model/host_pool.HostKVPool.apply), and every storage prefetch's
# reads (the fetch thread's exists + get). A store load lands in the host tier and is then
# copied to the device as a host load, so the store's ratio adds the two per-token times.
#
# Each mean is a least-squares rate through the origin, sum(seconds * tokens) / sum(tokens^2),
# with both sums decayed by DECAY per sample: a step's seconds per token weighed by its tokens
# squared. Long steps decide it: on a GPU a short prefill is launch-bound (an H100 took about
# the same 12 ms for 128 and 2,048 tokens of SmolLM2's shape, model/load_ratio.py), so a plain
# mean over a chat's short turns would price a token at up to 16x what a long prefix costs to
# recompute, and the ratio would call loads that much cheaper than they are.
#
# Before anything is timed. Where the engine has a host tier it measures one prefill and one
# host -> device copy at start-up (model/load_ratio.py) and seeds the prefill and host means
# with them, so the host ratio is a measured value from the first report. The store's ratio
# stays None until the first prefetch has read pages: the router then charges its default
# (DEFAULT_LOAD_RATIO, 0.1), and never less than the host ratio the engine reports.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DECAY = 0.9
"""Weight a sample keeps at each later sample of its mean: the last ~10 samples decide it."""


@dataclass(slots=True)
class RunningRate:
    """Seconds per token, decayed least squares through the origin (see above)."""

    weighted: float = 0.0  # decayed sum of seconds * tokens
    square: float = 0.0  # decayed sum of tokens ** 2
    samples: int = 0

    def add(self, seconds: float, tokens: int, decay: float = DECAY) -> None:
        if tokens <= 0 or seconds < 0:
            return
        self.weighted = decay * self.weighted + seconds * tokens
        self.square = decay * self.square + tokens * tokens
        self.samples += 1

    def per_token(self) -> float | None:
        return self.weighted / self.square if self.square > 0 else None


class LoadRatioMeter:
    """The three running means and the two ratios made of them."""

    def __init__(self, decay: float = DECAY) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.prefill, self.host, self.store = RunningRate(), RunningRate(), RunningRate()

    @classmethod
    def seeded(cls, sample: dict[str, Any] | None) -> LoadRatioMeter:
        """A meter whose prefill and host means start from the start-up measurement
        (``{"tokens", "prefill_s", "host_load_s"}``; None: nothing measured)."""
        meter = cls()
        if sample:
            meter.prefill.add(sample["prefill_s"], sample["tokens"])
            meter.host.add(sample["host_load_s"], sample["tokens"])
        return meter

    def prefilled(self, seconds: float, tokens: int) -> None:
        self.prefill.add(seconds, tokens, self.decay)

    def host_loaded(self, seconds: float, tokens: int) -> None:
        self.host.add(seconds, tokens, self.decay)

    def store_loaded(self, seconds: float, tokens: int) -> None:
        self.store.add(seconds, tokens, self.decay)

    def report(self) -> dict[str, Any]:
        """What the engine's stats (and ``/get_loads``) carry: both ratios (None: not measured
        yet), 3 significant digits, and how many samples each mean has taken."""
        prefill, host, store = (r.per_token() for r in (self.prefill, self.host, self.store))
        host_ratio = store_ratio = None
        if prefill:
            host_ratio = host / prefill if host is not None else None
            store_ratio = (store + (host or 0.0)) / prefill if store is not None else None
        return {
            **ratio_fields(host_ratio, store_ratio),
            "kv_load_timed_prefills": self.prefill.samples,
            "kv_load_timed_host_loads": self.host.samples,
            "kv_load_timed_store_loads": self.store.samples,
        }


def ratio_fields(host: float | None, store: float | None) -> dict[str, float | None]:
    """The two ratios under the names an engine reports them (3 significant digits)."""
    return {
        "kv_load_to_prefill_ratio": _sig3(host),
        "kv_store_load_to_prefill_ratio": _sig3(store),
    }


def _sig3(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.3g}")
