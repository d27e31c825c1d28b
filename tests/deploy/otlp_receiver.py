"""A real OTLP/HTTP trace receiver for tests: an HTTP server on a free loopback port that takes
`POST /v1/traces` (protobuf, gzip or not), decodes each export with opentelemetry-proto's
messages and keeps the spans, as a collector would receive them."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(res.get("service.name", ""), s.name, s.trace_id.hex(),
                                s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                s.start_time_unix_nano, s.end_time_unix_nano,
                                {a.key: _value(a.value) for a in s.attributes}))  # fmt: skip
    return out


class Receiver:
    """Serves in a thread until ``close``; ``spans`` grows as exports arrive."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.paths.append(self.path)
                receiver.spans.extend(decode(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, cond: Any, what: str, timeout: float = 30.0) -> list[Span]:
        """The spans once `cond(spans)` holds."""
        deadline = time.monotonic() + timeout
        while not cond(self.spans):
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.spans}"
            time.sleep(0.05)
        return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
