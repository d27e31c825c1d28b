"""The endpoint picker protocol's messages: Envoy's ext_proc protos (our subset, in protos/,
compiled when first imported) and the few builders and readers the service needs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import grpc

PROTOS = Path(__file__).with_name("protos")
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"


def _load() -> tuple[Any, Any]:
    """(messages, services) of ext_proc.proto; grpc_tools compiles it in process."""
    sys.path.insert(0, str(PROTOS))
    try:
        return grpc.protos_and_services("rsepp/ext_proc.proto")
    finally:
        sys.path.remove(str(PROTOS))


pb, services = _load()
core = sys.modules["rsepp.envoy_core_pb2"]


def header_map(headers: Any) -> dict[str, str]:
    """An HttpHeaders' headers as a dict (Envoy sends values in raw_value, older ones in value)."""
    return {h.key.lower(): (h.raw_value.decode("latin-1") or h.value) for h in headers.headers}


def subset(request: Any) -> set[str] | None:
    """The endpoints the proxy allows (its subset hint), None when it sets none."""
    meta = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta or SUBSET_KEY not in meta[SUBSET_NAMESPACE].fields:
        return None
    value = meta[SUBSET_NAMESPACE].fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "string_value":
        return {e.strip() for e in value.string_value.split(",") if e.strip()}
    return {v.string_value for v in value.list_value.values}


def served(request: Any, headers: dict[str, str]) -> str | None:
    """The endpoint the proxy says served the request (dynamic metadata or response header)."""
    meta = request.metadata_context.filter_metadata
    if LB_NAMESPACE in meta and SERVED in meta[LB_NAMESPACE].fields:
        return meta[LB_NAMESPACE].fields[SERVED].string_value
    return headers.get(SERVED)


def set_header(name: str, value: str) -> Any:
    """A header set that overwrites any value the client sent."""
    return core.HeaderValueOption(
        header=core.HeaderValue(key=name, raw_value=value.encode()),
        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def picked(endpoints: list[str], body: bytes, extra: dict[str, str]) -> list[Any]:
    """The answers to a buffered request: headers with the picks, primary first and the
    fallbacks a retry goes to after it, comma-separated (the same value in the `envoy.lb`
    dynamic metadata), then the whole body streamed back unchanged."""
    value = ",".join(endpoints)
    sets = [set_header(DESTINATION, value)] + [set_header(k, v) for k, v in extra.items()]
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets))
    meta = pb.ProcessingResponse().dynamic_metadata
    meta.update({LB_NAMESPACE: {DESTINATION: value}})
    head = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta
    )
    stream = pb.StreamedBodyResponse(body=body, end_of_stream=True)
    mutation = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=stream))
    return [head, pb.ProcessingResponse(request_body=pb.BodyResponse(response=mutation))]


def immediate(status: int, message: str, kind: str) -> Any:
    """An immediate response with an OpenAI-style error body."""
    import json

    body = json.dumps({"error": {"message": message, "type": kind, "code": status}})
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=sys.modules["rsepp.envoy_http_status_pb2"].HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[set_header("content-type", "application/json")]),
            body=body.encode(),
            details=f"radixserve_epp_{status}",
        )
    )


def headers_continue(response: bool = False) -> Any:
    """Let headers through unchanged."""
    common = pb.HeadersResponse(response=pb.CommonResponse())
    if response:
        return pb.ProcessingResponse(response_headers=common)
    return pb.ProcessingResponse(request_headers=common)


def trailers_continue(response: bool = False) -> Any:
    """Let trailers through unchanged."""
    if response:
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
