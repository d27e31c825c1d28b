"""The hermes format (alias qwen25): calls as JSON objects in <tool_call> tags."""

import pytest
from stream_checks import as_text, check, streamed, whole

from radixserve.chat.tool_parsers import get_tool_parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'


@pytest.mark.parametrize("name", ["hermes", "qwen25"])
def test_one_call_with_text_before_kept_as_content(name):
    _, calls = check(name, "Let me look.\n" + CALL, "Let me look.",
                     [("get_weather", {"city": "Paris", "days": [1, 2]})])  # fmt: skip
    assert calls[0][1] == '{"city": "Paris", "days": [1, 2]}'  # the model's own JSON text


def test_parallel_calls_and_text_between():
    two = CALL + "\n" + '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    check("hermes", two, None, [("get_weather", {"city": "Paris", "days": [1, 2]}),
                                ("add", {"a": 1, "b": 2})])  # fmt: skip
    check("hermes", CALL + "\nDone.", "Done.", [("get_weather", {"city": "Paris", "days": [1, 2]})])


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    two = CALL + '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    check("hermes", two, None, [("get_weather", {"city": "Paris", "days": [1, 2]})], max_calls=1)


def test_plain_text_and_a_tag_lookalike_stay_content():
    check("hermes", "The answer is 4 < 5.", "The answer is 4 < 5.", [])
    check("hermes", "a <tool_c", "a <tool_c", [])  # held back while streaming, then sent


def test_strings_with_tags_braces_and_escapes_inside_arguments():
    text = '<tool_call>{"name": "echo", "arguments": {"s": "}</tool_call> \\"q\\" \\u00e9"}}</tool_call>'
    check("hermes", text, None, [("echo", {"s": '}</tool_call> "q" é'})])


def test_a_call_without_closing_tag_at_the_end_is_whole():
    check("hermes", '<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})])


def test_missing_arguments_are_an_empty_object():
    check("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", {})])


@pytest.mark.parametrize("bad", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
])  # fmt: skip
def test_malformed_calls_come_back_as_text(bad):
    as_text("hermes", bad)


@pytest.mark.parametrize("bad", [
    '<tool_call>{"name": "f", "arguments": {"a": 1',  # cut short (max_tokens)
    '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',
])  # fmt: skip
def test_a_call_broken_inside_its_arguments_is_text_whole_and_in_a_stream_after_its_start(bad):
    assert whole("hermes", bad) == (bad, [])
    content, calls = streamed("hermes", bad)
    ((name, args),) = calls
    assert name == "f" and args.startswith('{"a": ') and args in bad
    assert content == bad  # what a stream sent cannot be taken back; the rest is content


def test_detect():
    parser = get_tool_parser("hermes")
    assert parser.detect("x " + CALL) and not parser.detect("no calls here")
