"""kv_aware tokenizes long prompts in the router's tokenizing threads (--tokenize-workers), not on
its event loop: a prompt still being tokenized holds up no other request, and a tokenizer that
fails, panics or hangs costs its request the token ids (routed on the approximate tree), never
an answer. The workers are fake-worker processes; the tokenizer is the built-in SmolLM2's,
wrapped so that a test decides when a long prompt's encoding may finish."""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("httptools")

from radixserve.config import with_flags  # noqa: E402
from radixserve.router.proxy import forwarding  # noqa: E402
from radixserve.router.proxy.config import RouterConfig  # noqa: E402
from radixserve.router.proxy.kv_setup import load_tokenizer  # noqa: E402
from test_router_app import (  # noqa: E402
    call,
    make_router,  # noqa: F401  (fixture)
    workers,  # noqa: F401  (fixture)
)

MARK = "LONG-PROMPT"
LONG = MARK + " " + "the router tokenizes this prompt in a thread. " * 180  # ~8,000 characters
SHORT = "a short prompt"


class GatedTokenizer:
    """The real tokenizer; encoding a text that holds MARK waits until the test opens the gate
    (at most `hold` seconds), and optionally fails instead of returning."""

    def __init__(self, hold: float = 15.0, fail: BaseException | None = None) -> None:
        self.inner = load_tokenizer("built-in:SmolLM2-135M")
        self.entered, self.gate, self.hold, self.fail = (
            threading.Event(),
            threading.Event(),
            hold,
            fail,
        )
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if MARK in text:
            self.entered.set()
            self.gate.wait(self.hold)
            if self.fail is not None:
                raise self.fail
        return self.inner.encode(text, add_special_tokens)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> str:
        return self.inner.apply_chat_template(messages, add_generation_prompt)

    def fingerprint(self) -> str:
        return self.inner.fingerprint()


def kv_router(make, urls: list[str], tok: GatedTokenizer, **overrides: object):  # noqa: ANN001, ANN201
    r = make(urls, policy="kv_aware", tokenizer="built-in:SmolLM2-135M", **overrides)
    r.router.kv.tokenizer = tok
    return r


def post_in_background(addr: str, text: str) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(
        target=lambda: out.append(call("POST", addr, "/generate", {"text": text})), daemon=True
    )
    thread.start()
    return thread, out


def metric(addr: str, name: str) -> float:
    text = call("GET", addr, "/metrics")[1]
    line = next(ln for ln in text.splitlines() if ln.startswith(f"radixserve_router_{name}"))
    return float(line.rsplit(" ", 1)[1])


def test_a_long_prompt_being_tokenized_holds_up_no_other_request(workers, make_router):  # noqa: F811
    tok = GatedTokenizer()
    r = kv_router(make_router, [w.url for w in workers[:2]], tok, tokenize_workers=2)
    long_thread, long_reply = post_in_background(r.addr, LONG)
    assert tok.entered.wait(10)  # the long prompt is being encoded now, and cannot finish yet
    status, _ = call("POST", r.addr, "/generate", {"text": SHORT})
    assert status == 200
    assert long_thread.is_alive() and not long_reply  # the short one went first
    tok.gate.set()
    long_thread.join(20)
    assert long_reply and long_reply[0][0] == 200
    # both were routed on their token ids: kv_aware counted each prompt's tokens, not key units
    expected = len(tok.inner.encode(LONG)) + len(tok.inner.encode(SHORT))
    assert r.router.policy.prompt_tokens == expected
    assert metric(r.addr, "kv_tokenize_errors_total") == 0
    # the long prompt was encoded on a tokenizing thread, the short one on the event loop's
    assert tok.threads[0].startswith("router-tokenize") and tok.threads[1] == r.thread.name


def test_tokenize_workers_0_keeps_tokenizing_on_the_event_loop(workers, make_router):  # noqa: F811
    """The old path, kept for comparison (benchmarks/router_decision_cost.py): every prompt is
    encoded on the loop's thread."""
    tok = GatedTokenizer()
    tok.gate.set()
    r = kv_router(make_router, [workers[0].url], tok, tokenize_workers=0)
    assert call("POST", r.addr, "/generate", {"text": LONG})[0] == 200
    assert tok.threads == [r.thread.name]


@pytest.mark.parametrize("kind", ["error", "panic"])
def test_a_failing_tokenizer_routes_the_request_without_token_ids(kind, workers, make_router):  # noqa: F811
    """A template or encoding error, or a panic in the tokenizer's Rust code (pyo3 raises a
    PanicException, a BaseException), is counted and the request still answered."""
    panic = type("PanicException", (BaseException,), {})
    fail = ValueError("bad input") if kind == "error" else panic("index out of bounds")
    tok = GatedTokenizer(fail=fail)
    tok.gate.set()
    r = kv_router(make_router, [workers[0].url], tok, tokenize_workers=2)
    status, body = call("POST", r.addr, "/generate", {"text": LONG})
    assert status == 200 and body["meta_info"]["worker"]
    assert metric(r.addr, "kv_tokenize_errors_total") == 1
    assert r.router.policy.prompt_tokens < len(tok.inner.encode(LONG))  # key units, not tokens


def test_a_stuck_tokenizer_delays_its_request_a_bounded_time(workers, make_router, monkeypatch):  # noqa: F811
    monkeypatch.setattr(forwarding, "TOKENIZE_TIMEOUT_SECS", 0.5)
    tok = GatedTokenizer(hold=30.0)
    r = kv_router(make_router, [workers[0].url], tok, tokenize_workers=1)
    try:
        status, _ = call("POST", r.addr, "/generate", {"text": LONG})
        assert status == 200
        assert metric(r.addr, "kv_tokenize_timeouts_total") == 1
        assert tok.entered.is_set() and not tok.gate.is_set()  # answered while still stuck
    finally:
        tok.gate.set()


def test_tokenize_workers_flag_bounds():
    assert with_flags(RouterConfig, tokenize_workers=0).tokenize_workers == 0
    assert RouterConfig().tokenize_workers >= 1  # on by default
    with pytest.raises(ValueError, match="tokenize_workers"):
        with_flags(RouterConfig, tokenize_workers=-1)


def test_a_long_body_that_is_no_json_object_is_a_400_from_the_pool(workers, make_router):  # noqa: F811
    tok = GatedTokenizer()
    r = kv_router(make_router, [workers[0].url], tok, tokenize_workers=2)
    for bad in (b"{" + b"x" * 4000, b"[" + b'"a",' * 2000 + b'"a"]'):
        status, body = call("POST", r.addr, "/generate", bad)
        assert status == 400 and "JSON object" in body["error"]["message"]
    assert call("POST", r.addr, "/generate", {"text": SHORT})[0] == 200  # still serving
