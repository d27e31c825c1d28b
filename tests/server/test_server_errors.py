"""Bad input to `radixserve serve` (tiny model): every refusal is a 4xx with an OpenAI-style error
body and the server goes on serving; a property-based fuzz run over the endpoints gets no 5xx."""

from __future__ import annotations

import http.client
import json

import pytest

from server_harness import ServerProcess, assert_error_body

OK_SAMPLING = {"max_new_tokens": 2, "temperature": 0}
TOO_LONG = "fox " * 200  # the server's context is 128 tokens
PAYLOAD_LIMIT = 65536  # --max-payload-size of the shared server (conftest.py)

# (name, path, raw body, status, code); a code of None: any
BAD = [
    ("malformed-json", "/v1/completions", b'{"prompt": "a", ', 400, "invalid_json"),
    ("not-utf8", "/generate", b'{"text": "\xff\xfe"}', 400, "invalid_json"),
    ("nan", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "invalid_json"),
    ("empty-body", "/v1/chat/completions", b"", 400, "invalid_json"),
    ("body-is-a-list", "/v1/completions", b"[1, 2]", 400, "invalid_type"),
    ("body-is-null", "/generate", b"null", 400, "invalid_type"),
    ("deep-nesting", "/generate", b"[" * 20_000 + b"]" * 20_000, 400, "invalid_json"),
    ("missing-prompt", "/v1/completions", {"max_tokens": 2}, 400, "missing_required_parameter"),
    ("missing-messages", "/v1/chat/completions", {"model": "x"}, 400, None),
    ("missing-text", "/generate", {"sampling_params": OK_SAMPLING}, 400, None),
    ("text-and-ids", "/generate", {"text": "a", "input_ids": [1]}, 400, None),
    ("prompt-number", "/v1/completions", {"prompt": 5}, 400, "invalid_type"),
    ("max-tokens-string", "/v1/completions", {"prompt": "a", "max_tokens": "2"}, 400, None),
    ("max-tokens-float", "/v1/completions", {"prompt": "a", "max_tokens": 2.5}, 400, None),
    ("messages-string", "/v1/chat/completions", {"messages": "hi"}, 400, None),
    ("messages-empty", "/v1/chat/completions", {"messages": []}, 400, None),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]}, 400, None),
    (
        "temperature-str",
        "/generate",
        {"text": "a", "sampling_params": {"temperature": "hot"}},
        400,
        None,
    ),  # fmt: skip
    ("sampling-list", "/generate", {"text": "a", "sampling_params": [1]}, 400, None),
    ("stream-string", "/v1/completions", {"prompt": "a", "stream": "yes"}, 400, None),
    ("max-tokens-0", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, None),
    (
        "max-tokens-neg",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": -3},
        400,
        None,
    ),  # fmt: skip
    (
        "max-new-tokens-neg",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        400,
        None,
    ),  # fmt: skip
    ("temperature-neg", "/v1/completions", {"prompt": "a", "temperature": -1}, 400, None),
    ("top-p-0", "/v1/completions", {"prompt": "a", "top_p": 0}, 400, None),
    ("n-0", "/v1/completions", {"prompt": "a", "n": 0}, 400, None),
    ("n-too-many", "/v1/completions", {"prompt": "a", "n": 9}, 400, None),
    ("batch-too-big", "/generate", {"text": ["a"] * 9}, 400, None),
    ("empty-prompt-list", "/v1/completions", {"prompt": []}, 400, None),
    ("empty-ids", "/generate", {"input_ids": []}, 400, None),
    ("id-out-of-vocab", "/generate", {"input_ids": [1, 10**6]}, 400, None),
    ("id-negative", "/v1/completions", {"prompt": [1, -1]}, 400, None),
    ("huge-int", "/v1/completions", {"prompt": "a", "max_tokens": 10**30}, 400, None),
    ("prompt-too-long", "/v1/completions", {"prompt": TOO_LONG}, 400, "context_length_exceeded"),
    (
        "chat-too-long",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": TOO_LONG}]},
        400,
        "context_length_exceeded",
    ),  # fmt: skip
    ("ids-too-long", "/generate", {"input_ids": [5] * 128}, 400, "context_length_exceeded"),
    (
        "prompt-plus-max-too-long",
        "/generate",
        {"text": "a b c", "sampling_params": {"max_new_tokens": 127}},
        400,
        "context_length_exceeded",
    ),  # fmt: skip
    (
        "unknown-model",
        "/v1/completions",
        {"prompt": "a", "model": "gpt-9"},
        404,
        "model_not_found",
    ),  # fmt: skip
    (
        "unknown-model-chat",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]},
        404,
        "model_not_found",
    ),  # fmt: skip
    ("suffix", "/v1/completions", {"prompt": "a", "suffix": "b"}, 400, "unsupported_parameter"),
    (
        "bad-regex",
        "/generate",
        {"text": "a", "sampling_params": {"regex": "[a-"}},
        400,
        "invalid_value",
    ),  # fmt: skip
    (
        "image-part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "unsupported_content",
    ),  # fmt: skip
    ("oversized", "/generate", {"text": "x" * PAYLOAD_LIMIT}, 413, "payload_too_large"),
]


@pytest.mark.parametrize(("path", "body", "status", "code"), [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])  # fmt: skip
def test_bad_input_is_a_4xx_with_an_error_body(tiny_server, path, body, status, code):
    reply = tiny_server.post(path, body)
    err = assert_error_body(reply, status)
    if code is not None:
        assert err["code"] == code, err


def test_the_server_serves_on_after_bad_input(tiny_server):
    for _, path, body, _, _ in BAD[:8]:
        tiny_server.post(path, body)
    assert tiny_server.get("/health").status == 200
    out = tiny_server.post("/generate", {"text": "a", "sampling_params": OK_SAMPLING})
    assert out.status == 200 and out.json()["meta_info"]["completion_tokens"] == 2


def test_oversized_chunked_body_is_refused(tiny_server):
    """No Content-Length to trust: the server counts the bytes as they come."""
    conn = http.client.HTTPConnection(tiny_server.host, tiny_server.port, timeout=30)
    chunks = (b'{"text": "' + b"x" * 8192 for _ in range(PAYLOAD_LIMIT // 8192 + 2))
    conn.request("POST", "/generate", body=chunks, encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 413
    assert json.loads(resp.read())["error"]["code"] == "payload_too_large"
    conn.close()


def test_unknown_paths_and_methods_get_error_bodies(tiny_server):
    assert_error_body(tiny_server.get("/v2/nothing"), 404)
    assert_error_body(tiny_server.get("/generate"), 405)
    assert_error_body(tiny_server.request("DELETE", "/v1/models"), 405)


def test_api_key_and_served_model_name():
    """--api-key: requests without it are a 401; --served-model-name: the name clients use
    (sim runner: starts in a second)."""
    server = ServerProcess(["--sim", "tiny-cpu", "--api-key", "sekret",
                            "--served-model-name", "my-model"])  # fmt: skip
    key = {"Authorization": "Bearer sekret"}
    try:
        err = assert_error_body(server.post("/v1/completions", {"prompt": "a"}), 401)
        assert err["type"] == "authentication_error"
        assert_error_body(server.post("/v1/completions", {"prompt": "a"},
                                      headers={"Authorization": "Bearer wrong"}), 401)  # fmt: skip
        assert_error_body(server.request("GET", "/v1/models"), 401)
        assert server.name == "my-model"
        models = server.request("GET", "/v1/models", headers=key).json()["data"]
        assert [m["id"] for m in models] == ["my-model"]
        ok = server.post("/v1/completions", {"prompt": "a", "max_tokens": 1, "model": "my-model"},
                         headers=key)  # fmt: skip
        assert ok.status == 200 and ok.json()["model"] == "my-model"
        assert server.get("/health").status == 200  # probes need no key
    finally:
        server.stop()
