"""Anthropic's error shape on the wire: the error type its API gives each HTTP status, and the
error object (or a stream's last event) a client of /v1/messages reads. One map for the server
and for the router's own answers on that route. Pure: plain data in and out."""

from __future__ import annotations

import json
from typing import Any

# Anthropic's error types by HTTP status (its "Errors" page); any other 4xx is
# invalid_request_error, any other 5xx api_error
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def error_type(status: int) -> str:
    """The ``error.type`` Anthropic's clients expect with ``status``."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object (it has no ``param``: a message names the field at fault)."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_event(status: int, message: str) -> bytes:
    """The ``error`` event that ends a stream too late for a status code."""
    data = json.dumps(error_body(status, message), ensure_ascii=False)
    return b"event: error\ndata: " + data.encode() + b"\n\n"
