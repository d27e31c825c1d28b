"""A config field's bounds, kept in its metadata (``ge``, ``gt``, ``le``, ``lt``; ``also``: values
allowed besides, such as -1 for "off"): what is wrong with a value, and the check every config runs.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from typing import Any


def bound_problem(value: Any, meta: typing.Mapping[str, Any]) -> str | None:
    """What is wrong with ``value`` under the bounds in ``meta``, or None (None is no value)."""
    if value is None or isinstance(value, bool) or value in meta.get("also", ()):
        return None
    if isinstance(value, float) and math.isnan(value):
        return "must be a number (got nan)"
    for key, op, holds in _BOUNDS:
        if key in meta and not holds(value, meta[key]):
            also = "".join(f" or {a}" for a in meta.get("also", ()))
            shown = f"{value:g}" if isinstance(value, float) else repr(value)
            return f"must be {op} {meta[key]}{also} (got {shown})"
    return None


_BOUNDS = (("ge", ">=", operator.ge), ("gt", ">", operator.gt),
           ("le", "<=", operator.le), ("lt", "<", operator.lt))  # fmt: skip


def check_fields(obj: Any) -> None:
    """Refuse a field outside its metadata's bounds: ValueError naming the field."""
    for f in dataclasses.fields(obj):
        if problem := bound_problem(getattr(obj, f.name), f.metadata):
            raise ValueError(f"{f.name} {problem}")
