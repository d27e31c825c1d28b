"""Checks of a setting against this machine, run on the command line only (a field's ``check``,
an argparse ``type``): a torch device that is here, a directory or output file this can write."""

from __future__ import annotations

import argparse
import os


def device_problem(text: str) -> str | None:
    """What keeps ``text`` from naming a usable torch device (torch imported only if not cpu)."""
    if text == "cpu":
        return None
    try:
        import torch
    except ImportError:
        return f"{text!r} needs torch (pip install 'radixserve[engine]')"

    try:
        device = torch.device(text)
    except RuntimeError:
        return f"is not a torch device (got {text!r}; e.g. cpu, cuda, cuda:1)"
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", lambda: False)()
    if not available:
        return f"has no usable {device.type} device here (torch {torch.__version__}; got {text!r})"
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        return f"names {device.type} device {device.index}, but only {count} are here"
    return None


def dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be a directory this process writes in (it may be made later)."""
    p = os.path.expanduser(path)
    while not os.path.exists(p):  # the closest existing ancestor decides
        p = os.path.dirname(p.rstrip("/")) or "."
    if not os.path.isdir(p):
        return f"{p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"cannot write in {p}"
    return None


def writable_file(path: str) -> str:
    """argparse ``type`` of an output file: refused at once if it cannot be written later (the
    file is opened for appending, and removed again if this made it)."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"no directory {parent} to write {path} in")
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {e.strerror}") from None
    if not existed:
        os.remove(path)
    return path
