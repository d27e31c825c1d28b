"""Incremental detokenization: no broken UTF-8 in any delta, stop strings cut and never leaked."""

from __future__ import annotations

from radixserve.engine.detokenizer import IncrementalDetokenizer, _detokenize
from radixserve.engine.messages import AbortReq, CloseStream, StopReq, TokenBatch, TokenOut
from radixserve.engine.scheduler_proc import Worker
from radixserve.sched.request import FinishReason
from test_sched_support import make_req

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


class _Sent(list):
    def send_pyobj(self, msg: object) -> None:
        self.append(msg)


def test_a_stop_string_tells_the_scheduler_and_the_stream_is_freed_on_close() -> None:
    detok = IncrementalDetokenizer(decode)
    detok.open("r", ("STOP",))
    to_sched = _Sent()
    outs = [TokenOut("r", [b], False, None, 3, 0, i + 1) for i, b in enumerate(b"ab STOP cd")]
    texts = [t for out in outs for t in _detokenize(detok, TokenBatch([out]), to_sched)]
    assert "".join(t.text for t in texts) == "ab "
    assert to_sched == [StopReq("r")]  # once, when the stop string completed
    assert "r" in detok.streams  # kept while the scheduler may still send tokens
    detok.close("r")
    assert detok.streams == {}
    assert detok.feed(TokenOut("r", [65], True, "length", 3, 0, 11)) is None  # late: dropped
    assert detok.streams == {}


def test_the_scheduler_process_closes_the_stream_of_an_aborted_or_stopped_request() -> None:
    class Sched:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        def abort(self, rid: str) -> None:
            self.calls.append(("abort", rid))

        def finish(self, rid: str, reason: FinishReason) -> None:
            self.calls.append((reason.value, rid))

    sched, push = Sched(), _Sent()
    worker = Worker(sched, None, None, push, False)  # type: ignore[arg-type]
    worker.live.update({rid: make_req(rid, [1, 2, 3]) for rid in ("a", "s")})
    worker.handle(AbortReq("a"))
    worker.handle(StopReq("s"))
    worker.handle(StopReq("gone"))  # finished here before the stop arrived: still closed
    assert sched.calls == [("abort", "a"), ("stop", "s"), ("stop", "gone")]
    assert push == [CloseStream("a"), CloseStream("s"), CloseStream("gone")]
    assert worker.live == {}
