"""Request fields turned into SamplingParams values where the wire form differs: OpenAI's
``logit_bias`` (token ids as JSON keys) and the one grammar a request may name."""

from __future__ import annotations

import json

from radixserve.server.errors import ApiError


def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as JSON keys) as (token id, bias) pairs; the server
    checks the ids against the vocabulary."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isascii() or not key.isdigit():
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}",
                           param="logit_bias")  # fmt: skip
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def grammar_of(
    json_schema: str | None = None, regex: str | None = None, any_json: bool = False
) -> tuple[str, str] | None:
    """The one grammar a request constrains its output with; a 400 if it names two."""
    given = [g for g in (("json_schema", json_schema), ("regex", regex)) if g[1] is not None]
    given += [("json", "")] if any_json else []
    if len(given) > 1:
        raise ApiError(400, "give at most one of json_schema and regex", param=given[1][0])
    if given and given[0][0] == "json_schema":
        try:
            json.loads(given[0][1])
        except ValueError as e:
            raise ApiError(400, f"json_schema is not valid JSON: {e}", param="json_schema") from e
    return given[0] if given else None
