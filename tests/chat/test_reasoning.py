"""Reasoning parsers qwen3 and deepseek-r1, whole and one character at a time."""

import pytest

from radixserve.chat.reasoning import get_reasoning_parser


def streamed(name: str, text: str) -> tuple[str, str]:
    stream = get_reasoning_parser(name).stream()
    parts = [stream.feed(c) for c in text] + [stream.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


CASES = [  # text, qwen3's (reasoning, content), deepseek-r1's
    ("<think>\nLet me add.\n</think>\n\n4", ("\nLet me add.\n", "4"), ("\nLet me add.\n", "4")),
    ("Let me add.</think>4", ("", "Let me add.</think>4"), ("Let me add.", "4")),
    ("4", ("", "4"), ("4", "")),
    ("<think>cut short", ("cut short", ""), ("cut short", "")),
    (
        "<thinking is not the tag",
        ("", "<thinking is not the tag"),
        ("<thinking is not the tag", ""),
    ),
    ("", ("", ""), ("", "")),
]


@pytest.mark.parametrize("text,qwen3,r1", CASES)
def test_whole_and_streamed_agree(text, qwen3, r1):
    for name, want in (("qwen3", qwen3), ("deepseek-r1", r1)):
        split = get_reasoning_parser(name).split(text, True)
        assert (split.reasoning, split.content) == want
        assert streamed(name, text) == want


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(KeyError, match="qwen3"):
        get_reasoning_parser("nope")
