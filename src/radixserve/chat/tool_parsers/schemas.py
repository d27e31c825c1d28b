"""Pieces of the structural tags (xgrammar's format, as plain data) that constrain each format's
calls: the schema of one call object, a tagged call, a tagged JSON list of calls."""

from __future__ import annotations

from typing import Any


def call_schema(tool: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call object of ``tool`` ({"name": ..., args_key: {...}})."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}  # fmt: skip


def one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def tagged(begin: str, schema: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": {"type": "json_schema",
            "json_schema": schema}, "end": end}  # fmt: skip


def json_list(begin: str, item: dict[str, Any], end: str, parallel: bool) -> dict[str, Any]:
    """``begin`` + a JSON list of calls (one unless ``parallel``) + ``end``."""
    schema = {"type": "array", "items": item, "minItems": 1} | ({} if parallel else {"maxItems": 1})
    return tagged(begin, schema, end)
