"""The llama3 format: the answer is a JSON call (parameters), optional <|python_tag|>, ';'
between calls."""

import pytest
from stream_checks import as_text, check, sent_then_text

ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  "])
def test_one_call(prefix):
    check("llama3", prefix + ONE, None, [("get_weather", {"city": "Paris"})])


def test_calls_separated_by_semicolons_and_arguments_key():
    text = ONE + '; {"name": "add", "arguments": {"a": 1}}'
    check("llama3", text, None, [("get_weather", {"city": "Paris"}), ("add", {"a": 1})])


def test_text_is_content():
    check("llama3", "It is sunny in Paris.", "It is sunny in Paris.", [])
    check("llama3", "<|python", "<|python", [])


def test_text_after_a_call_makes_it_text():
    sent_then_text("llama3", '{"name": "f", "parameters": {}} and then text')


@pytest.mark.parametrize("bad", ["{not json}",
                                 '{"parameters": {}}', '{"name": "f"'])  # fmt: skip
def test_malformed_come_back_as_text(bad):
    as_text("llama3", bad)
