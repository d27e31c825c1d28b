"""The prefill engine's bootstrap server and the decode engine's look-up of it.

As SGLang's: an HTTP server on ``--disaggregation-bootstrap-port`` whose ``GET /route`` tells a
decode engine where the prefill engine's scheduler listens (``rank_ip``, ``rank_port``) and what
its KV looks like; ``GET /health`` answers OK. A decode engine looks a (host, port) up and
keeps the answer a short while; a request's ``bootstrap_room`` then goes straight to that
scheduler.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LOOKUP_TIMEOUT_S = 5.0
ROUTE_TTL_S = 2.0  # one look-up per prefill engine every 2 s at most, under any load


class BootstrapServer:
    """Serves ``route`` (a JSON object) on an already bound socket, in a daemon thread."""

    def __init__(self, sock: socket.socket, route: dict[str, Any]) -> None:
        body = json.dumps(route).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                path = self.path.split("?", 1)[0]
                if path == "/route":
                    self._answer(200, body, "application/json")
                elif path == "/health":
                    self._answer(200, b"OK", "text/plain")
                else:
                    self._answer(404, b'{"error": "not found"}', "application/json")

            def _answer(self, code: int, data: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # quiet: a decode engine polls it
                pass

        self.httpd = ThreadingHTTPServer(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self.httpd.socket.close()
        self.httpd.socket = sock
        sock.listen(64)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def bind_bootstrap(host: str, port: int) -> socket.socket:
    """The bootstrap port, bound now so that one in use fails the start (OSError)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class RouteCache:
    """Decode side: (bootstrap host, port) -> the prefill scheduler's ZeroMQ endpoint, asked
    again once ``ttl`` seconds old: a prefill engine restarted on the same bootstrap port binds
    a new scheduler port, and rooms sent to the old one would only end at their bound."""

    def __init__(self, ttl: float = ROUTE_TTL_S) -> None:
        self.ttl = ttl
        self._known: dict[tuple[str, int], tuple[str, float]] = {}

    async def endpoint(self, host: str, port: int) -> str:
        """The endpoint; ConnectionError (saying which server) if it cannot be learned."""
        key, now = (host, port), time.monotonic()
        got = self._known.get(key)
        if got is None or now - got[1] > self.ttl:
            route = await asyncio.to_thread(_get_route, host, port)
            got = self._known[key] = (f"tcp://{route['rank_ip']}:{int(route['rank_port'])}", now)
        return got[0]


def _get_route(host: str, port: int) -> dict[str, Any]:
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/route"
    try:
        with urllib.request.urlopen(url, timeout=LOOKUP_TIMEOUT_S) as resp:
            route = json.loads(resp.read())
        if not isinstance(route, dict) or "rank_port" not in route:
            raise ValueError("no rank_port in its answer")
    except (OSError, ValueError) as e:
        raise ConnectionError(f"the bootstrap server at {host}:{port} did not answer /route: "
                              f"{e}") from None  # fmt: skip
    return route
