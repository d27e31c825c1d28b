"""Process plumbing shared by the engine's child processes: ZeroMQ endpoints, exiting when the
parent dies (so a killed server never leaves orphans behind), and the OpenMP settings the model
process starts with."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import MutableMapping
from dataclasses import dataclass

# The OpenMP variables that decide how torch's idle threads wait (libgomp reads them once, when
# torch loads it): a user who sets either keeps exactly what they set.
OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


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


def omp_wait_settings(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The OpenMP wait settings the model process runs with (``OMP_WAIT_POLICY``,
    ``GOMP_SPINCOUNT``, as the user set them; none set: libgomp's spinning default), for the
    engine's info. The engine sets neither.

    Why not ``PASSIVE`` by default: on cores of its own a spinning thread answers the next
    parallel region at once, and ``benchmarks/engine_bench.py`` on this 2-core machine, quiet,
    ran 1.12-1.25x faster spinning than with ``PASSIVE``. Where other processes share the cores
    (a CI runner, a workstation, a second engine), a spinning thread holds a core its partner
    needs: a batch-8 decode step then took 4-11x as long as with ``PASSIVE``
    (``benchmarks/cpu_threads.py``), so set ``OMP_WAIT_POLICY=PASSIVE`` there. Read before torch
    is imported in this process (libgomp reads the variables when it loads)."""
    out = {v: environ[v] for v in OMP_WAIT_VARS if v in environ}
    if "torch" in sys.modules:
        out["note"] = "read after torch was imported: a change made since does not apply"
    return out
