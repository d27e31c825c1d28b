"""The router's own error answers, in the shape of the API the client speaks: Anthropic's on
/v1/messages (its clients read ``error.type`` there, and a stream's ``error`` event), OpenAI's
everywhere else. Worker answers are relayed as the worker shaped them; only errors the router
makes (auth, no worker, bad JSON, failed attempts, a stream cut) are shaped here."""

from __future__ import annotations

import json
from http import HTTPStatus

from radixserve.chat import anthropic_errors

CODES = {s.value: s.phrase.lower().replace(" ", "_").replace("-", "_") for s in HTTPStatus}
ANTHROPIC = "/v1/messages"


def error_body(status: int, message: str, kind: str = "", code: str = "") -> dict[str, object]:
    """OpenAI-style error object; `code` is a short string, as the server's (e.g. "not_found")."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None,
                      "code": code or CODES.get(status, "error")}}  # fmt: skip


def speaks_anthropic(path: str) -> bool:
    """Whether a request to `path` is Anthropic's Messages API (count_tokens included)."""
    return path == ANTHROPIC or path.startswith(ANTHROPIC + "/")


def error_for(path: str, status: int, message: str, kind: str = "", code: str = "") -> object:
    """The router's error answer to a request to `path`: Anthropic's shape on /v1/messages (its
    type follows the status there; `kind` and `code` are OpenAI's), else OpenAI's."""
    if speaks_anthropic(path):
        return anthropic_errors.error_body(status, message)
    return error_body(status, message, kind, code)


def stream_end(path: str, status: int, message: str) -> bytes:
    """The events that end a stream cut mid-way: Anthropic's ``error`` event on /v1/messages
    (its streams have no [DONE]); elsewhere an error event then [DONE], as OpenAI-compatible
    servers (vLLM, smg) end theirs."""
    if speaks_anthropic(path):
        return anthropic_errors.error_event(status, message)
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"
