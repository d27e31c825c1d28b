"""Incremental detokenization: no broken UTF-8 in any delta, stop strings cut and never leaked."""

from __future__ import annotations

from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.messages import TokenOut

# a byte-level toy tokenizer: token id = one byte, so multi-byte characters span several tokens


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def feed_all(text: str, stop: tuple[str, ...] = (), finish: bool = True) -> list:
    detok = IncrementalDetokenizer(decode)
    detok.open("r", stop)
    data = list(text.encode())
    outs = []
    for i, b in enumerate(data):
        last = finish and i == len(data) - 1
        out = TokenOut("r", [b], last, "length" if last else None, 3, 0, i + 1)
        outs.append(detok.feed(out))
    return outs


def test_deltas_never_split_a_character() -> None:
    text = "héllo → wörld 🎉 done"
    outs = feed_all(text)
    assert all("\ufffd" not in o.text for o in outs)
    assert "".join(o.text for o in outs) == text
    assert outs[-1].finished and outs[-1].finish_reason == "length"


def test_stop_string_cuts_output_and_is_not_streamed() -> None:
    outs = feed_all("alpha beta STOP gamma", stop=("STOP",), finish=False)
    shown = [o for o in outs if o is not None]
    assert "".join(o.text for o in shown) == "alpha beta "
    assert shown[-1].finished and shown[-1].finish_reason == "stop"
    assert shown[-1].matched_stop == "STOP"
    assert outs[-1] is None  # tokens after the stop are dropped


def test_partial_stop_prefix_is_released_when_it_is_not_a_stop() -> None:
    outs = feed_all("a ST b", stop=("STOP",))
    streamed = [o.text for o in outs]
    assert "".join(streamed) == "a ST b"
    # "S" and "ST" were held back while they could still begin "STOP"
    assert streamed[2] == "" and streamed[3] == ""
