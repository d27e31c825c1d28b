"""The smollm2 format: one JSON list of calls in <tool_call> tags (SmolLM2-Instruct's)."""

import pytest
from stream_checks import as_text, check, sent_then_text

TWO = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
       '{"name": "add", "arguments": {"a": 1.5, "b": -2}}]</tool_call>')  # fmt: skip


def test_parallel_calls_in_one_list():
    check("smollm2", TWO, None, [("get_weather", {"city": "Paris"}), ("add", {"a": 1.5, "b": -2})])


def test_text_before_is_content_and_one_call_when_not_parallel():
    check("smollm2", "Sure.\n" + TWO, "Sure.", [("get_weather", {"city": "Paris"})], max_calls=1)


def test_an_empty_list_is_no_call():
    check("smollm2", "<tool_call>[]</tool_call>", None, [])


def test_plain_answer():
    check("smollm2", "Paris is the capital of France.", "Paris is the capital of France.", [])


@pytest.mark.parametrize("bad", [
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',  # an object, not a list
    "<tool_call>[1, 2]</tool_call>",
])  # fmt: skip
def test_malformed_lists_come_back_as_text(bad):
    as_text("smollm2", bad)


def test_text_after_the_list_inside_the_tags_makes_it_text():
    sent_then_text("smollm2", '<tool_call>[{"name": "f", "arguments": {}}] extra</tool_call>')
