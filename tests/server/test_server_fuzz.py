"""Property-based fuzzing of `radixserve serve` (tiny model): random JSON bodies, each field
either a plausible value or any JSON at all, never get a 5xx; a 4xx always has an error body."""

from __future__ import annotations

import json

import pytest

from server_harness import ServerProcess, assert_error_body

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = 150

scalar = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
          | st.text(max_size=12))  # fmt: skip
anything = st.recursive(
    scalar, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                                      max_size=3),
    max_leaves=6,
)  # fmt: skip
# values at the edges of what a field of any type accepts
edges = st.sampled_from([-1, 0, 1, 2**31, 2**63, -(2**63), 1e308, -0.0, 0.5, "", "1", [], {},
                         [[]], None, True, False])  # fmt: skip

# Each field's values that the server should accept; a body gets up to two of its fields
# replaced by an edge value or any JSON.
token_ids = st.lists(st.integers(0, 319), min_size=1, max_size=6)
# text includes lone surrogates: JSON can carry them ("\ud800"), UTF-8 cannot
text = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=30)
small = st.integers(1, 6)
stop = st.text(min_size=0, max_size=3) | st.lists(st.text(max_size=3), max_size=3)
SAMPLING = {
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 400),
    "seed": st.integers(-(2**70), 2**70),
    "stop": stop,
    "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(),
}
OPENAI = {
    **SAMPLING,
    "model": st.sampled_from(["llama3", "default"]),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
}
part = st.fixed_dictionaries({"type": st.just("text")}, optional={"text": text})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
     "content": text | st.none() | st.lists(part, max_size=2)},
    optional={"name": text},
)  # fmt: skip
BODIES = {
    "/v1/completions": {
        **OPENAI,
        "prompt": text
        | token_ids
        | st.lists(text, min_size=1, max_size=2)
        | st.lists(token_ids, min_size=1, max_size=2),
        "echo": st.just(False),
        "logprobs": st.none(),
        "max_tokens": small,
    },
    "/v1/chat/completions": {
        **OPENAI,
        "messages": st.lists(message, min_size=1, max_size=3),
        "max_tokens": small,
        "max_completion_tokens": small,
        "logprobs": st.just(False),
    },
    "/generate": {
        "text": text | st.lists(text, min_size=1, max_size=2),
        "input_ids": token_ids | st.lists(token_ids, min_size=1, max_size=2),
        "sampling_params": st.fixed_dictionaries(
            {}, optional={"max_new_tokens": small, "sampling_seed": SAMPLING["seed"], **SAMPLING}
        ),
        "stream": st.booleans(),
        "rid": text,
    },
}
# the prompt, and the field that caps the generation: set in most bodies so that the run stays
# short (a missing limit means up to the whole context); /generate takes one of two prompts
REQUIRED = {"/v1/completions": ("prompt", "max_tokens"),
            "/v1/chat/completions": ("messages", "max_tokens"), "/generate": ()}  # fmt: skip
PROMPTS = ("text", "input_ids")


mostly = st.sampled_from([True] * 9 + [False])


@st.composite
def body_for(draw: st.DrawFn, path: str) -> dict:
    fields = BODIES[path]
    optional = {k: v for k, v in fields.items() if k not in PROMPTS}
    body = draw(st.fixed_dictionaries({}, optional=optional))
    if path == "/generate" and draw(mostly):
        name = draw(st.sampled_from(PROMPTS))
        body[name] = draw(fields[name])
    for name in REQUIRED[path]:
        if draw(mostly):
            body.setdefault(name, draw(fields[name]))
    if path == "/generate" and draw(mostly):
        body["sampling_params"] = {**body.get("sampling_params", {}),
                                   "max_new_tokens": draw(small)}  # fmt: skip
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        body[name] = draw(edges | anything)
    return body


requests = st.sampled_from(sorted(BODIES)).flatmap(
    lambda path: st.tuples(st.just(path), body_for(path) | body_for(path) | anything)
)


def check_reply(server: ServerProcess, path: str, body: object) -> None:
    reply = server.post(path, json.dumps(body))
    assert reply.status < 500, (reply.status, reply.body[:500])
    if reply.status >= 400:
        assert_error_body(reply)
    elif reply.headers["content-type"].startswith("text/event-stream"):
        events = reply.events()
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert isinstance(reply.json(), dict | list)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(request=requests)
def test_random_bodies_never_get_a_5xx(tiny_server, request):
    path, body = request
    check_reply(tiny_server, path, body)


def test_the_server_is_healthy_after_fuzzing(tiny_server):
    assert tiny_server.get("/health").status == 200
    assert tiny_server.wait_idle()["kv_usage"] == 0.0
    assert not tiny_server.errors()
