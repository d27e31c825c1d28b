"""The pythonic format: a Python list of calls with keyword arguments."""

import pytest
from stream_checks import as_text, check, sent_then_text, streamed


def test_parallel_calls_with_python_literals():
    text = "[get_weather(city=\"Paris\", units=None), add(a=1, b=[2, 3], flag=True, s='a)b')]"
    check("pythonic", text, None, [("get_weather", {"city": "Paris", "units": None}),
                                   ("add", {"a": 1, "b": [2, 3], "flag": True, "s": "a)b"})])  # fmt: skip


def test_no_arguments_and_dotted_names():
    check("pythonic", "[tools.noop()]", None, [("tools.noop", {})])


def test_arguments_come_whole_once_the_call_closes():
    _, calls = streamed("pythonic", "[f(a=1), g(b='x')]")
    assert calls == [("f", '{"a": 1}'), ("g", '{"b": "x"}')]


def test_text_is_content():
    check("pythonic", "No tools needed.", "No tools needed.", [])


@pytest.mark.parametrize("bad", ["[f(a=1)", "[f(a=1) g()]"])
def test_a_list_broken_after_a_call_is_text(bad):
    sent_then_text("pythonic", bad)


@pytest.mark.parametrize("bad", ["[1, 2]", "[]", "[f(1)]", "[f(a=x)]", "[f(**kw)]"])
def test_malformed_come_back_as_text(bad):
    as_text("pythonic", bad)
