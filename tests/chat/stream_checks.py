"""What every tool-call format's tests check: a text parsed whole, and fed to a stream one
character at a time, gives the same content and calls; deltas have OpenAI's shape."""

from __future__ import annotations

import json
import re
from typing import Any

from radixserve.chat.calls import Parsed
from radixserve.chat.tool_parsers import get_tool_parser

ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


def streamed(name: str, text: str, step: int = 1, **kw: Any) -> tuple[str | None, list[tuple]]:
    """Content and (name, arguments) calls a stream sends for ``text`` fed ``step`` chars at a
    time; asserts the deltas' shape on the way."""
    stream = get_tool_parser(name, **kw).stream()
    deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i : i + step])]
    deltas += stream.finish()
    content, calls = "", []
    for d in deltas:
        assert len(d) == 1, d
        if "content" in d:
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:  # the first delta of a call: index, id, type, name
            assert tc["index"] == len(calls) and ID.match(tc["id"]) and tc["type"] == "function"
            calls.append([tc["function"]["name"], tc["function"]["arguments"]])
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            assert tc["function"]["arguments"], "an empty fragment"
            calls[tc["index"]][1] += tc["function"]["arguments"]
    return content or None, [tuple(c) for c in calls]


def whole(name: str, text: str, **kw: Any) -> tuple[str | None, list[tuple]]:
    parsed: Parsed = get_tool_parser(name, **kw).parse(text)
    for c in parsed.calls:
        assert ID.match(c.id)
    return parsed.content, [(c.name, c.arguments) for c in parsed.calls]


def check(name: str, text: str, content: str | None, calls: list[tuple[str, dict]], **kw: Any):
    """``text`` parses, whole and streamed (1 and 3 characters at a time), to ``content`` and
    ``calls`` (arguments compared as JSON objects)."""
    got = whole(name, text, **kw)
    assert got[0] == content
    assert [(n, json.loads(a)) for n, a in got[1]] == calls
    for step in (1, 3):
        assert streamed(name, text, step, **kw) == got
    return got


def as_text(name: str, text: str) -> None:
    """A malformed call: all of ``text`` is content, whole and streamed."""
    assert whole(name, text) == (text, [])
    assert streamed(name, text) == (text, [])


def sent_then_text(name: str, text: str) -> None:
    """Calls that broke after they were complete: all of ``text`` is content whole; a stream
    already sent the calls (it cannot take them back) and sends the text as content too."""
    assert whole(name, text) == (text, [])
    content, calls = streamed(name, text)
    assert content == text and calls
