"""The mistral format: [TOOL_CALLS] and a JSON list of calls."""

import pytest
from stream_checks import as_text, check

CALLS = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "noop", "arguments": {}}]'


def test_parallel_calls():
    check("mistral", CALLS, None, [("get_weather", {"city": "Paris"}), ("noop", {})])


def test_text_before_and_after_the_list_is_content():
    check(
        "mistral",
        "Checking. " + CALLS + " ok",
        "Checking.  ok",
        [("get_weather", {"city": "Paris"}), ("noop", {})],
    )


def test_a_lookalike_marker_is_content():
    check("mistral", "[TOOL] is not a marker", "[TOOL] is not a marker", [])


@pytest.mark.parametrize("bad", ["[TOOL_CALLS]oops", '[TOOL_CALLS]{"name": "f"}', "[TOOL_CALLS][{"])
def test_malformed_come_back_as_text(bad):
    as_text("mistral", bad)
