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


def default_omp_wait_policy(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Make torch's OpenMP threads sleep, not spin, while they wait (``OMP_WAIT_POLICY=PASSIVE``),
    unless the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``; return the two as they now are.

    Why: libgomp's own default spins every idle thread ~300,000 times at each barrier, and a
    decode step has ~150 barriers (five parallel kernels a layer). Where other processes share the
    cores (a CI runner, a workstation, a second engine), a spinning thread holds a core its
    partner needs to finish the region: on 2 shared cores a batch-8 decode step of SmolLM2-135M
    took 4-6x as long as with PASSIVE (``benchmarks/cpu_threads.py``). Must run before torch is
    imported in this process (it is a no-op afterwards, and says so in the result)."""
    if not any(v in environ for v in OMP_WAIT_VARS):
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
    out = {v: environ[v] for v in OMP_WAIT_VARS if v in environ}
    if "torch" in sys.modules:
        out["note"] = "set after torch was imported: libgomp's own default applies"
    return out
