"""Command-line flags made from config dataclasses (one argument group per config, each value
kept in its field's bounds), configs built back from the parsed flags, and ``CliParser``, whose
errors are one line and exit status 2 before any process starts."""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from radixserve.config_bounds import bound_problem

T = TypeVar("T")


def choices_of(choices: tuple[str, ...] | str) -> tuple[str, ...]:
    """A field's choices: listed, or "module:NAME" of a registry read when the flags are made
    (registries that import radixserve.config cannot be imported by it at load time)."""
    if isinstance(choices, str):
        return tuple(lazy_attr(*choices.split(":")))
    return choices


def lazy_attr(module: str, name: str) -> Any:
    """``module``'s ``name``, looked up when called (for modules that import radixserve.config)."""
    import importlib

    return getattr(importlib.import_module(module), name)


def bounded(tp: Callable[[str], Any], **meta: Any) -> Callable[[str], Any]:
    """argparse ``type``: ``tp`` whose value must keep ``meta``'s bounds (and ``check``)."""

    def convert(text: str) -> Any:
        value = tp(text)  # ValueError: argparse says "invalid int value: 'x'"
        problem = bound_problem(value, meta) or (meta["check"](value) if "check" in meta else None)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = getattr(tp, "__name__", "value")
    return convert


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, title: str, check: bool = True, group: Any = None
) -> None:
    """Add one ``--flag-name`` per field of ``cls`` to a new argument group; each value keeps its
    field's bounds. A field whose type is itself a config dataclass (settings shared by several
    commands) adds its own fields' flags to the same group, under their own names. With
    ``check`` (and a ``CliParser``), ``cls`` is built right after parsing, so its
    ``__post_init__`` refuses bad combinations before the command runs."""
    group = parser.add_argument_group(title) if group is None else group
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            add_dataclass_args(parser, tp, title, False, group)  # type: ignore[arg-type]
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata.get("help")}
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if "choices" in f.metadata:
            kw["choices"] = choices_of(f.metadata["choices"])
        if f.metadata.get("repeat"):  # --prefill URL [PORT] --prefill URL2: one list each
            nargs = "+" if f.metadata["repeat"] is True else f.metadata["repeat"]
            kw.update(action="append", nargs=nargs, default=None, metavar=f.metadata.get("metavar"))
            group.add_argument(flag, **kw)
            continue
        if typing.get_origin(tp) is tuple:  # a list flag, as in sglang-router: --worker-urls A B C
            tp = typing.get_args(tp)[0]
            kw.update(nargs="*", metavar=f.metadata.get("metavar"))
        group.add_argument(flag, type=bounded(tp, **f.metadata), **kw)
    if check:
        add_check(parser, lambda args: from_args(cls, args))


def add_check(
    parser: argparse.ArgumentParser, check: Callable[[argparse.Namespace], object]
) -> None:
    """Run ``check`` on the parsed arguments before the command (a CliParser's only)."""
    if isinstance(parser, CliParser):
        parser.checks.append(check)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from the parsed arguments that share its field names (and its nested
    configs' field names: see add_dataclass_args)."""
    return from_flags(cls, vars(args))


def flag_names(cls: type) -> set[str]:
    """The flag names (field names) of ``cls``, its nested configs' included."""
    hints = typing.get_type_hints(cls)
    names: set[str] = set()
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        names |= flag_names(tp) if dataclasses.is_dataclass(tp) else {f.name}
    return names


def from_flags(cls: type[T], values: Mapping[str, Any]) -> T:
    """Build ``cls`` from flat flag values, as the command line gives them: a nested config is
    built from the values named as its fields. Names ``cls`` has no flag for are left out."""
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            kw[f.name] = from_flags(tp, values)  # type: ignore[arg-type]
        elif f.name in values:
            kw[f.name] = values[f.name]
    return cls(**kw)


def with_flags(cls: type[T], **values: Any) -> T:
    """``cls`` built from flag values given by name (``with_flags(RouterConfig, port=0,
    cache_threshold=0.7)``); a name that is no flag of ``cls`` is a TypeError."""
    unknown = sorted(set(values) - flag_names(cls))
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(unknown)}")
    return from_flags(cls, values)


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit status 2: ``radixserve serve: error:
    --max-wait-ms must be >= 0 (got -5); see radixserve serve --help``, never the usage. Its
    ``checks`` run on the parsed arguments (a ValueError is such an error), before the command;
    subparsers made from it are CliParsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list[Callable[[argparse.Namespace], object]] = []

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        for check in self.checks:
            try:
                check(parsed)
            except ValueError as e:
                self.error(str(e))
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_flag_first(message)}; see {self.prog} --help\n")


def _flag_first(message: str) -> str:
    """argparse's "argument --x: must be ..." as "--x must be ..."; one line."""
    message = " ".join(message.split())
    m = re.fullmatch(r"argument (\S+): (.*)", message)
    if m is None:
        return message
    flag, what = m.groups()
    return (
        f"{flag} {what}"
        if what.startswith(("must", "has ", "names ", "is "))
        else f"{flag}: {what}"
    )
