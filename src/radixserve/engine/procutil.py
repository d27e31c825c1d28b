"""Process plumbing shared by the engine's child processes: ZeroMQ endpoints and exiting when
the parent dies, so a killed server never leaves orphans behind."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Endpoints:
    sched: str  # the scheduler process pulls here (from the API process and the detokenizer)
    detok: str  # the detokenizer pulls here (from the scheduler process)
    tm: str  # the API process pulls here (from the detokenizer)

    @classmethod
    def new(cls) -> Endpoints:
        base = os.path.join(tempfile.gettempdir(), f"radixserve-{uuid.uuid4().hex[:12]}")
        return cls(f"ipc://{base}-sched", f"ipc://{base}-detok", f"ipc://{base}-tm")

    @property
    def died(self) -> str:
        """A file where a child process that stops the engine on purpose says why."""
        return self.sched.removeprefix("ipc://").removesuffix("-sched") + "-died"

    def death_note(self) -> str | None:
        try:
            with open(self.died) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def cleanup(self) -> None:
        for path in (self.sched, self.detok, self.tm, self.died):
            try:
                os.unlink(path.removeprefix("ipc://"))
            except OSError:
                pass


def exit_with_parent(parent_pid: int, interval: float = 0.5) -> None:
    """Start a daemon thread that ends this process once ``parent_pid`` is gone. Also lift the
    hold on SIGINT and SIGTERM that a child inherits from ``launch`` (it starts children with
    them held), so that ``terminate()`` works."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
