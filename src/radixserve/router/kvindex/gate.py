"""PURE: Llumnix's down-gating of a KV metadata service (Redis, Mooncake's master), shared by the
router's readers of both: after every try of a lookup failed the service is down for
`--kvs-metadata-service-down-duration-s`, and lookups in that window are not tried at all. The
caller passes the clock (the event loop's, or time.monotonic)."""

from __future__ import annotations

import math


class KvsGate:
    """Up, or down until a time. Pure: the caller passes the clock."""

    def __init__(self, down_duration_s: float) -> None:
        self.down_duration_s = down_duration_s
        self.down_until = -math.inf
        self.times_down = 0

    def up(self, now: float) -> bool:
        return now >= self.down_until

    def mark_down(self, now: float) -> None:
        self.down_until, self.times_down = now + self.down_duration_s, self.times_down + 1

    def mark_up(self) -> None:
        self.down_until = -math.inf
