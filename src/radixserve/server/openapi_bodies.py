"""The request bodies in the OpenAPI document: every route that reads and validates its JSON
body itself names its model, and the models' schemas go into the document's components."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from radixserve.server.control_bodies import (
    AbortRequest,
    DetokenizeRequest,
    InternalState,
    TokenizeRequest,
)
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

BODIES: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    GenerateRequest,
    TokenizeRequest,
    DetokenizeRequest,
    AbortRequest,
    InternalState,
)


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads and validates its JSON body itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_body_schemas(
    openapi: dict[str, Any], more: tuple[type[BaseModel], ...] = ()
) -> dict[str, Any]:
    """Put the request bodies' JSON schemas (``BODIES`` and ``more``) into an OpenAPI
    document's components."""
    _, top = models_json_schema(
        [(m, "validation") for m in BODIES + more], ref_template="#/components/schemas/{model}"
    )
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(top.get("$defs", {}))
    return openapi
