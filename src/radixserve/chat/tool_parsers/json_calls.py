"""What the JSON formats share: a call as a JSON object read as it arrives, and a text cut into
content and sections that a marker opens (``<tool_call>``, ``[TOOL_CALLS]``)."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.chat.calls import Call, Piece, Text
from radixserve.chat.jsonscan import Malformed, members, skip_ws
from radixserve.chat.tool_parsers.base import held

# reads the calls of a section whose JSON starts at an index: (calls, where the JSON ends)
ReadCalls = Callable[[str, int], tuple[list[Call], int | None]]


def object_call(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[Call, int | None]:
    """The call written as the object at ``start`` ({"name": ..., "arguments": {...}}), and
    where the object ends (None while open)."""
    if text[start] != "{":
        raise Malformed("a call is a JSON object")
    found, end = members(text, start)
    by_key = {m.key: m for m in found}
    name_m = by_key.get("name")
    name = name_m.value(text) if name_m and name_m.end is not None else None
    if name is not None and not isinstance(name, str):
        raise Malformed("a call's name is a string")
    args_m = next((by_key[k] for k in args_keys if k in by_key), None)
    args = args_m.raw(text) if args_m else ""
    if args and not args.startswith("{"):
        raise Malformed("a call's arguments are an object")
    if end is not None and name is None:
        raise Malformed("a call names its function")
    return Call(name, args or ("{}" if end is not None else ""), end is not None), end


def list_calls(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[list[Call], int | None]:
    """The calls of a JSON list of call objects at ``start``, and where the list ends."""
    if text[start] != "[":
        raise Malformed("expected a list of calls")
    found, end = members(text, start)
    return [object_call(text, m.start, args_keys)[0] for m in found], end


def one_call(args_keys: tuple[str, ...]) -> ReadCalls:
    def read(text: str, start: int) -> tuple[list[Call], int | None]:
        call, end = object_call(text, start, args_keys)
        return [call], end

    return read


def many_calls(args_keys: tuple[str, ...]) -> ReadCalls:
    def read(text: str, start: int) -> tuple[list[Call], int | None]:
        return list_calls(text, start, args_keys)

    return read


def sections(
    text: str, final: bool, opener: str, closer: str | None, read: ReadCalls
) -> list[Piece]:
    """``text`` cut into content and the calls of each section ``opener`` JSON ``closer`` (to
    the JSON's end where ``closer`` is None). A malformed section is content."""
    pieces: list[Piece] = []
    at = 0
    while True:
        i = text.find(opener, at)
        if i < 0:
            keep = len(text) - at - (0 if final else held(text[at:], opener))
            return pieces + ([Text(text[at : at + keep])] if keep > 0 else [])
        if i > at:
            pieces.append(Text(text[at:i]))
        try:
            calls, end = _section(text, i + len(opener), final, closer, read)
        except Malformed:
            calls, end = None, _after_closer(text, i, closer)
        pieces += calls if calls is not None else [Text(text[i:end])]
        if end is None:
            return pieces
        at = end


def _section(
    text: str, body: int, final: bool, closer: str | None, read: ReadCalls
) -> tuple[list[Call], int | None]:
    """The calls of one section and where it ends (None while open)."""
    v = skip_ws(text, body)
    if v >= len(text):
        if final:
            raise Malformed("nothing after the opener")
        return [], None
    calls, end = read(text, v)
    if end is None:
        if final:
            raise Malformed("the output ended inside a call")
        return calls, None
    if closer is None:
        return calls, end
    after = skip_ws(text, end)
    if text.startswith(closer, after):
        return calls, after + len(closer)
    tail = text[after:]
    if not tail and final:  # the output ended before the closer: the calls are whole
        return calls, len(text)
    if not final and closer.startswith(tail):
        return calls, None
    raise Malformed(f"text after a call: {tail[:20]!r}")


def _after_closer(text: str, opener_at: int, closer: str | None) -> int | None:
    """Where a malformed section ends: after its closer, or (none) the output's end."""
    if closer is None:
        return None
    j = text.find(closer, opener_at)
    return None if j < 0 else j + len(closer)
