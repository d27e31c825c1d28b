"""The scheduler process's answers to the API's control requests (flush, stats, the integrity
recount, the KV-event snapshot, run-time scheduler settings). Mixed into ``Worker``."""

from __future__ import annotations

import dataclasses
from typing import Any

from radixserve.engine.kv_events import KVEventPlane
from radixserve.engine.load_meter import LoadRatioMeter
from radixserve.engine.messages import ControlReq
from radixserve.sched.scheduler import Scheduler

FLUSH_WAIT_S = 2.0  # a flush waits this long for the storage writer to read its pinned pages
# (under the API's 5 s control timeout; still pinned after it: the flush is refused, 409)


class ControlOps:
    """The control ops the API process sends between two steps."""

    __slots__ = ()  # Worker is a slotted dataclass: no __dict__ from here

    scheduler: Scheduler
    events: KVEventPlane | None
    storage: Any
    meter: LoadRatioMeter | None
    ratios: dict[str, Any]
    pd: Any
    steps: int
    step_s: float
    runner_s: float

    def _control(self, msg: ControlReq) -> Any:
        if msg.op == "flush_cache":
            if self.storage is not None:  # pages the writer is reading: a moment to finish
                self.storage.release_pins(self.scheduler.kv, wait_s=FLUSH_WAIT_S)
            flushed = self.scheduler.flush_cache()
            if flushed and self.events is not None:
                self.events.cleared()
            return flushed
        if msg.op == "stats":
            stats = dataclasses.asdict(self.scheduler.stats())
            if self.storage is not None:
                stats.update(self.storage.stats())
            stats.update(engine_steps=self.steps, engine_step_seconds=self.step_s,
                         engine_runner_seconds=self.runner_s)  # fmt: skip
            return {**stats, **(self.meter.report() if self.meter else self.ratios)}
        if msg.op == "check_integrity":
            return self._integrity()
        if msg.op == "kv_events_snapshot":
            return self.events.snapshot() if self.events is not None else None
        if msg.op == "kv_events_stats":
            return self.events.stats() if self.events is not None else {}
        if msg.op == "scheduler_config":  # the live settings, changed or not
            return dataclasses.asdict(self.scheduler.config)
        if msg.op == "update_scheduler_settings":
            return self._update_settings(msg.args or {})
        return {"error": f"unknown control op {msg.op!r}"}

    def _integrity(self) -> dict[str, Any]:
        """The scheduler's recount, and where every KV slot is (free, evictable in the tree,
        or held); a disaggregated engine's rooms too."""
        s = self.scheduler
        try:
            s.check_integrity()
            error = None
        except AssertionError as e:
            error = str(e) or "an integrity check failed"
        pd = self.pd.counts() if self.pd is not None else {}
        return {"ok": error is None, "error": error, "total": s.kv.total,
                "free": s.allocator.available(), "evictable": s.cache.evictable_size(),
                "running": s.num_running, "waiting": s.num_waiting,
                "receiving": len(s.receiving), "rooms": pd,
                "transfer": getattr(self.pd, "sent", None)}  # fmt: skip

    def _update_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Between two steps, so no batch is in flight; a refused change changes nothing."""
        try:
            config = self.scheduler.update_settings(**changes)
        except (TypeError, ValueError) as e:
            return {"error": str(e)}
        return {"scheduler": dataclasses.asdict(config)}
