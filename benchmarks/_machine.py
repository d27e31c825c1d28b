"""One line that says which machine a benchmark ran on (benchmarks print it with every result)."""

from __future__ import annotations

import os
import platform
import subprocess


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return (
        f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} cpus ({cpu}), "
        f"python {platform.python_version()}"
    )


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after ``grace_s``, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
