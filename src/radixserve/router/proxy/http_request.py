"""A client's request as the router's connections read it (method, path and query, the headers
the router acts on, the body), its request id, and the refusal queued in its place when it
cannot be read within limits."""

from __future__ import annotations

import itertools
import os

from radixserve.router.proxy.errors import speaks_anthropic

_IDS = itertools.count()
_ID_PREFIX = os.urandom(8).hex()  # unique per router process; a counter makes it per request


def request_id(given: bytes) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one."""
    if given and len(given) <= 128 and given.isascii() and all(32 < c < 127 for c in given):
        return given.decode()
    return f"{_ID_PREFIX}{next(_IDS):08x}"


class Request:
    __slots__ = ("method", "path", "query", "auth", "body", "keep_alive", "http11", "rid",
                 "session", "trace")  # fmt: skip

    def __init__(
        self,
        method: str,
        url: str,
        auth: bytes,
        body: bytes,
        keep_alive: bool,
        rid: str,
        http11: bool = True,
        session: bytes = b"",
        trace: bytes = b"",
        api_key: bytes = b"",
    ) -> None:
        self.method, self.auth, self.body, self.keep_alive = method, auth, body, keep_alive
        self.path, _, self.query = url.partition("?")
        if api_key and not auth and speaks_anthropic(self.path):
            # Anthropic's clients send their key as x-api-key: the server takes it as the
            # bearer key on /v1/messages, and so do the router and the worker it forwards to
            self.auth = b"Bearer " + api_key
        self.http11, self.rid, self.session = http11, rid, session
        self.trace = trace  # the client's W3C traceparent (b"": none)


class Refusal:
    """An error answer queued behind the pipelined requests before it; the connection ends
    after it. `path`: the refused request's, where its URL was read (it chooses the shape)."""

    __slots__ = ("status", "message", "headers", "path")

    def __init__(self, status: int, message: str, headers: bytes = b"", path: str = "") -> None:
        self.status, self.message, self.headers, self.path = status, message, headers, path
