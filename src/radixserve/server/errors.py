"""OpenAI-style errors: one exception type for every refusal and the handlers that turn it, the
engine's errors and the framework's into ``{"error": {message, type, param, code}}`` bodies."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from radixserve.engine.tokenizer_manager import EngineDeadError, RequestError
from radixserve.server.responses import JSONBody

log = logging.getLogger("radixserve.server")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class ApiError(Exception):
    """A request the server refuses; ``status`` is the HTTP status, ``code`` a short name."""

    def __init__(
        self, status: int, message: str, code: str = "invalid_value", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @classmethod
    def from_engine(cls, e: RequestError, param: str | None = None) -> ApiError:
        # the engine's err_type is OpenAI's "type"; a specific one doubles as the code
        code = "invalid_value" if e.err_type == "invalid_request_error" else e.err_type
        return cls(e.code, e.message, code, param or getattr(e, "param", None))

    @classmethod
    def from_validation(cls, e: ValidationError | RequestValidationError) -> ApiError:
        """The first field pydantic refused, by its dotted path. A value that matches no member
        of a union fails once per member: their common path is the field, and all say why."""
        errors = e.errors()
        first = errors[0]
        locs = [[str(p) for p in err.get("loc", ()) if p != "body"] for err in errors]
        same = [err for err, loc in zip(errors, locs) if loc[:1] == locs[0][:1]]
        path = _common_prefix([loc for loc, err in zip(locs, errors) if err in same])
        param = ".".join(path) or None
        kind = first.get("type", "")
        code = "invalid_json" if kind == "json_invalid" else _validation_code(kind)
        why = "; or ".join(dict.fromkeys(str(err.get("msg", "invalid")) for err in same[:4]))
        return cls(400, f"{param}: {why}" if param else why, code, param)

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "")
        return {
            "error": {
                "message": self.message,
                "type": kind or "server_error",
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONBody(self.body(), status_code=self.status, headers=headers)


def _common_prefix(paths: list[list[str]]) -> list[str]:
    out = paths[0]
    for p in paths[1:]:
        n = 0
        while n < min(len(out), len(p)) and out[n] == p[n]:
            n += 1
        out = out[:n]
    return out


def _validation_code(kind: str) -> str:
    if kind == "missing":
        return "missing_required_parameter"
    if kind.endswith("_type") or kind in ("union_tag_invalid", "model_attributes_type"):
        return "invalid_type"
    return "invalid_value"


def install_handlers(app: FastAPI) -> None:
    """Every failure leaves as an OpenAI-style body; only our own bugs are 5xx (besides 503)."""

    async def on_api(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, ApiError)
        return e.response()

    async def on_engine(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, RequestError)
        return ApiError.from_engine(e).response()

    async def on_validation(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, RequestValidationError | ValidationError)
        return ApiError.from_validation(e).response()

    async def on_http(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_value")
        return ApiError(e.status_code, str(e.detail), code).response()

    async def on_gone(request: Request, _: Exception) -> Response:
        # nobody reads this answer; its generations were aborted when the client went away
        log.debug("client left %s %s before its answer", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def on_bug(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(e).__name__}", "internal_error").response()

    app.add_exception_handler(ApiError, on_api)
    app.add_exception_handler(EngineDeadError, on_engine)
    app.add_exception_handler(RequestError, on_engine)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(ClientGone, on_gone)
    app.add_exception_handler(ClientDisconnect, on_gone)  # gone while its body was read
    app.add_exception_handler(Exception, on_bug)
