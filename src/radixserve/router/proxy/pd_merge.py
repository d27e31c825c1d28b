"""What a PD router changes in a request and its answer: SGLang's bootstrap fields in, and the
prefill worker's input logprobs merged into the decode worker's /generate answer (whole or as
server-sent events), as SGLang's router does for ``return_logprob``. Plain data: no I/O."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
"""The prompt's logprobs: computed where the prompt was (the prefill worker); a decode worker
answers them empty, so the merge is the prefill side's followed by the decode side's."""


def refusal(body: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(message, param) when a PD router cannot honour ``body``; None when it can."""
    given = [f for f in BOOTSTRAP_FIELDS if body.get(f) is not None]
    if given:
        return (f"{', '.join(given)}: a PD router fills the bootstrap fields itself (send the "
                "request without them)", given[0])  # fmt: skip
    if path == "/v1/completions" and body.get("echo") and body.get("logprobs") is not None:
        return ("echo with logprobs (the prompt's logprobs) is not merged across prefill and "
                "decode workers by this router: use /generate with return_logprob and "
                "logprob_start_len", "echo")  # fmt: skip
    return None


def with_bootstrap(body: dict[str, Any], url: str, port: int, room: int) -> bytes:
    """``body`` for both workers of a pair: the prefill worker's host and bootstrap port, and
    the room (one room per request; the engines number a batch's rooms room + i)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    return json.dumps({**body, **fields}).encode()


def wants_merge(body: dict[str, Any], path: str) -> bool:
    """Whether the client asked /generate for logprobs (the prompt's among them, maybe)."""
    asked = body.get("return_logprob")
    return path == "/generate" and (any(asked) if isinstance(asked, list) else bool(asked))


def prompt_logprobs(prefill_body: bytes, streamed: bool) -> dict[int, dict[str, list]]:
    """The prefill answer's input logprobs by request index (a batch answers a list; a stream
    answers events, each with its ``index``)."""
    items = _events(prefill_body) if streamed else _listed(json.loads(prefill_body))
    out: dict[int, dict[str, list]] = {}
    for i, item in enumerate(items):
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            continue
        got = {k: meta[k] for k in INPUT_KEYS if isinstance(meta.get(k), list)}
        if got:
            out[item.get("index", i) if streamed else i] = got
    return out


def merge_whole(decode_body: bytes, inputs: dict[int, dict[str, list]]) -> bytes:
    """The decode answer (one object or a batch's list) with the prefill side's input logprobs
    put in front of its own."""
    parsed = json.loads(decode_body)
    for i, item in enumerate(_listed(parsed)):
        _merge_item(item, inputs.get(i))
    return json.dumps(parsed, separators=(",", ":")).encode()


def _merge_item(item: Any, got: dict[str, list] | None) -> None:
    meta = item.get("meta_info") if isinstance(item, dict) else None
    if not got or not isinstance(meta, dict):
        return
    for key, values in got.items():
        own = meta.get(key)
        meta[key] = values + (own if isinstance(own, list) else [])


class EventMerger:
    """A decode worker's /generate event stream, passed on with the prefill side's input
    logprobs merged into each event that carries meta_info; events wait (in order) until the
    prefill answer is in, which comes about when the decode side's first token does."""

    def __init__(self, out: Callable[[bytes], None]) -> None:
        self.out = out
        self.inputs: dict[int, dict[str, list]] | None = None
        self.held, self.partial = [], b""

    def feed(self, data: bytes) -> None:
        """Bytes of the decode stream, as they arrive."""
        self.partial += data
        *whole, self.partial = self.partial.split(b"\n\n")
        self.held.extend(whole)
        self._flush()

    def prefill_done(self, inputs: dict[int, dict[str, list]]) -> None:
        self.inputs = inputs
        self._flush()

    def close(self) -> None:
        """The stream ended: whatever is held goes out (unmerged if the prefill side never
        answered), the tail included."""
        if self.inputs is None:
            self.inputs = {}
        self._flush()
        if self.partial:
            self.out(self.partial)
            self.partial = b""

    def _flush(self) -> None:
        if self.inputs is None or not self.held:
            return
        events, self.held = self.held, []
        self.out(b"".join(self._merged(e) + b"\n\n" for e in events))

    def _merged(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {") or not self.inputs:
            return event
        item = json.loads(event[6:])
        _merge_item(item, self.inputs.get(item.get("index", 0)))
        return b"data: " + json.dumps(item, separators=(",", ":")).encode()


def _listed(parsed: Any) -> list[Any]:
    return parsed if isinstance(parsed, list) else [parsed]


def _events(body: bytes) -> list[Any]:
    """The JSON objects of a server-sent-event body (the last one per index wins later)."""
    out = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: {"):
            try:
                out.append(json.loads(block[6:]))
            except ValueError:
                continue
    return out
