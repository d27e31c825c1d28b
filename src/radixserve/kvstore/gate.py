"""Down-gating of a remote service, as Llumnix gates its KV metadata service: after a failure the
service is down for a fixed duration, during which callers do not wait on it at all."""

# A failure marks the service down for `down_duration_s`; calls in that window are refused at
# once (the caller recomputes, or routes without the store); the first call after the window
# tries again, and its success brings the service back. Transitions are returned to the caller
# so that it logs each outage once, not once per request. The clock is injectable so tests do
# not sleep.

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class DownGate:
    down_duration_s: float
    clock: Callable[[], float] = time.monotonic
    up: bool = True
    down_until: float = 0.0
    outages: int = 0  # up -> down transitions
    failures: int = 0
    refused: int = 0  # calls not tried because the service was down
    last_error: str = ""
    _trying: bool = field(default=False, repr=False)

    def allow(self) -> bool:
        """May a call go to the service now? (Down and within the duration: no.)"""
        if self.up or self.clock() >= self.down_until:
            return True
        self.refused += 1
        return False

    def failed(self, error: str) -> bool:
        """Record a failure; True when this failure took the service down (log it once)."""
        self.failures += 1
        self.last_error = error
        self.down_until = self.clock() + self.down_duration_s
        if not self.up:
            return False
        self.up = False
        self.outages += 1
        return True

    def succeeded(self) -> bool:
        """Record a success; True when the service just came back."""
        came_back = not self.up
        self.up = True
        return came_back
