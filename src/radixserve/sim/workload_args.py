"""Command-line flags for the workloads (``--workload NAME`` plus every generator's parameters),
shared by `radixserve sim` and `radixserve bench`."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable
from typing import Any

from radixserve.config import bounded
from radixserve.sim.workloads import (
    WORKLOADS,
    MultiTurnConfig,
    ReplyFn,
    TraceConfig,
    WorkloadRequest,
    multi_turn_chat,
)


def _base_type(tp: Any) -> Any:
    """``int`` for ``int | None``: argparse converts to the type that is not None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


# a flag whose name reads better than the field's
_ALIASES = {"path": ("--trace", "--path"), "seed": ("--workload-seed",)}


def _fields() -> dict[str, tuple[Any, list[str], Any]]:
    """field name -> (type, workloads that have it, metadata: help and bounds) over every
    workload config."""
    out: dict[str, tuple[Any, list[str], Any]] = {}
    for name, (cls, _) in WORKLOADS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in out:
                out[f.name] = (_base_type(hints[f.name]), [], f.metadata)
            out[f.name][1].append(f"{name}: {f.default}")
    return out


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """``--workload`` and one flag per workload parameter (unset: that workload's default)."""
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="generated-shared-prefix",
        help="which requests to send",
    )
    for name, (tp, defaults, meta) in _fields().items():
        flags = _ALIASES.get(name, ("--" + name.replace("_", "-"),))
        kw: dict[str, Any] = {"dest": f"wl_{name}", "default": None}
        kw["help"] = f"{meta.get('help', '')} (defaults: {'; '.join(defaults)})"
        if tp is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        else:
            group.add_argument(*flags, type=bounded(tp, **meta), metavar=name.upper(), **kw)


def workload_options(args: argparse.Namespace) -> dict[str, Any]:
    """The parameters given for the chosen workload; a parameter it lacks is an error."""
    cls, _ = WORKLOADS[args.workload]
    known = {f.name for f in dataclasses.fields(cls)}
    given = {k[3:]: v for k, v in vars(args).items() if k.startswith("wl_") and v is not None}
    if unknown := sorted(set(given) - known):
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        raise ValueError(f"workload {args.workload!r} has no parameter {flags}")
    return given


def workload_config(args: argparse.Namespace) -> Any:
    """The chosen workload's config from the flags (a trace is checked, not read, here)."""
    cls, _ = WORKLOADS[args.workload]
    config = cls(**workload_options(args))
    if cls is TraceConfig and config.path is None:
        raise ValueError("--workload trace needs --trace PATH")
    if cls is TraceConfig and not os.path.isfile(config.path):
        raise ValueError(f"--trace {config.path}: no such file")
    return config


def make_requests(
    args: argparse.Namespace, reply_fn: ReplyFn | None = None
) -> tuple[Any, list[WorkloadRequest]]:
    """The workload's config and its requests; chat replies come from ``reply_fn`` if given."""
    cls, generate = WORKLOADS[args.workload]
    config = workload_config(args)
    if cls is MultiTurnConfig:
        chat: Callable[..., list[WorkloadRequest]] = multi_turn_chat
        return config, chat(config, reply_fn)
    return config, generate(config)


def finite(obj: Any) -> Any:
    """``obj`` with every inf or nan float written as a string, so the JSON is strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
