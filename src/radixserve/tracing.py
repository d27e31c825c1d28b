"""OpenTelemetry traces (`--enable-trace`): a tracer that exports over OTLP/HTTP, reads and
writes W3C `traceparent` values, and records spans whose times are already known. The SDK is
the optional extra radixserve[trace], imported here only once tracing is on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.config import TRACE_EXTRA, TraceConfig

Attributes = Mapping[str, str | int | float | bool]


def open_tracer(config: TraceConfig, service: str) -> Tracer | None:
    """A Tracer for `service` when --enable-trace is set, else None (nothing imported)."""
    return Tracer(config, service) if config.enable_trace else None


class Tracer:
    """One process's spans: its own provider (no global state), a batching exporter on its own
    thread (the event loop and the engine loop never wait on the collector)."""

    def __init__(self, config: TraceConfig, service: str) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            raise ValueError(TRACE_EXTRA) from None
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = OTLPSpanExporter(endpoint=config.traces_url)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("radixserve")
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT,
                       "internal": SpanKind.INTERNAL}  # fmt: skip

    def _context(self, parent: Any) -> Any:
        """An OpenTelemetry context from a traceparent string, a span, or None (a new trace)."""
        if parent is None or isinstance(parent, str):
            return self._propagator.extract({"traceparent": parent} if parent else {})
        from opentelemetry.trace import set_span_in_context

        return set_span_in_context(parent)

    def start(
        self, name: str, parent: Any = None, kind: str = "internal",
        attributes: Attributes | None = None, start_ns: int | None = None,
    ) -> Any:  # fmt: skip
        """A started span (end it with ``span.end()``); `parent` as for ``record``."""
        return self._tracer.start_span(name, self._context(parent), self._kinds[kind],
                                       attributes, start_time=start_ns)  # fmt: skip

    def record(
        self, name: str, parent: Any, start_ns: int, end_ns: int,
        attributes: Attributes | None = None,
    ) -> None:  # fmt: skip
        """A span of known times under `parent`: a traceparent value, a span, or None."""
        self.start(name, parent, "internal", attributes, start_ns).end(end_ns)

    def traceparent(self, span: Any) -> str:
        """The W3C traceparent that makes a callee's spans children of `span`."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, self._context(span))
        return carrier["traceparent"]

    def close(self) -> None:
        """Export what is buffered, then stop the exporter's thread."""
        self._provider.shutdown()
