"""A tiny loopback worker that speaks the engine's HTTP API, for router tests and benchmarks.
Run `python tests/fake_worker.py --port 0`; it prints `READY <port>` once it listens.

It answers instantly (or after `--token-delay-ms` per generated token, streamed or not) and
keeps a toy prefix cache (chained hashes of 64-character blocks, LRU beyond `--cache-chars`) so
that it can report the hit rate a real engine with that much KV cache would see. Test hooks: POST /fake/fail {"count": n, "status": 500, "chunked": false} fails the next n
generation requests (with a chunked body if asked, as a failing stream would); POST /fake/health {"ok": false} makes /health answer 503.
Non-streamed answers carry the X-Request-Id the worker was sent (as "request_id") and an
X-Fake-Worker header; `--api-key` makes it refuse requests without that bearer key.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys
import time
from collections import OrderedDict

import httptools

BLOCK = 64
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class FakeEngine:
    """Request handling without I/O: which answer a path and body get."""

    def __init__(self, name: str, model: str, cache_chars: int = 0) -> None:
        self.name, self.model = name, model
        self.capacity = cache_chars // BLOCK if cache_chars > 0 else 2_000_000
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.prompt_chars = self.cached_chars = self.requests = self.in_flight = 0
        self.fail_count, self.fail_status, self.fail_chunked, self.healthy = 0, 500, False, True
        self.api_key, self.stats = b"", {"num_waiting": 0, "kv_usage": 0.0}

    def prompt_of(self, path: str, req: dict) -> str:
        if path == "/v1/chat/completions":
            return "".join(f"{m.get('role')}: {m.get('content')}\n" for m in req["messages"])
        prompt = req.get("text", req.get("prompt", req.get("input_ids", "")))
        return prompt if isinstance(prompt, str) else json.dumps(prompt)

    def cache(self, prompt: str) -> int:
        """Characters of `prompt` found cached (whole blocks); then caches all of it, evicting
        the least recently used blocks beyond capacity."""
        h, hit, hits, blocks = 0, True, 0, self.blocks
        for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
            h = hash((h, prompt[start : start + BLOCK]))
            if hit and h in blocks:
                hits += BLOCK
                blocks.move_to_end(h)
            else:
                hit = False
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        self.prompt_chars += len(prompt)
        self.cached_chars += hits
        return hits

    def info(self) -> dict:
        rate = self.cached_chars / self.prompt_chars if self.prompt_chars else 0.0
        return {
            "worker": self.name,
            "model_path": self.model,
            "requests": self.requests,
            "cache_hit_rate": rate,
            "prompt_chars": self.prompt_chars,
            "cached_chars": self.cached_chars,
        }

    def tokens(self, req: dict) -> list[str]:
        params = req.get("sampling_params") or req
        n = int(params.get("max_new_tokens") or params.get("max_tokens") or 4)
        return [f" t{i}" for i in range(n)]

    def final(self, path: str, req: dict, text: str, prompt: str, cached: int) -> dict:
        meta = {"worker": self.name, "prompt_chars": len(prompt), "cached_chars": cached}
        if path == "/generate":
            return {"text": text, "meta_info": meta}
        obj = "chat.completion" if "chat" in path else "text_completion"
        choice = {"index": 0, "finish_reason": "length"}
        if "chat" in path:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": "fake", "object": obj, "model": self.model, "choices": [choice], **meta}

    def chunk(self, path: str, piece: str, so_far: str) -> dict:
        if path == "/generate":
            return {"text": so_far, "meta_info": {"worker": self.name}}
        if "chat" in path:
            return {"object": "chat.completion.chunk", "choices": [{"delta": {"content": piece}}]}
        return {"object": "text_completion", "choices": [{"text": piece}], "worker": self.name}


class WorkerConn(asyncio.Protocol):
    """One client connection: parse with httptools, answer requests in order."""

    def __init__(self, engine: FakeEngine, token_delay: float) -> None:
        self.engine, self.token_delay = engine, token_delay
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url, self.body, self.rid, self.auth = b"", [], b"", b""
        self.queue: asyncio.Queue | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.reply(400, {"error": "bad request"})
            self.transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"x-request-id":
            self.rid = value
        elif name == b"authorization":
            self.auth = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path, body = self.url.decode().split("?")[0], b"".join(self.body)
        self.url, self.body = b"", []
        method = self.parser.get_method().decode()
        key, auth, self.auth = self.engine.api_key, self.auth, b""
        if key and path not in ("/health", "/fake/fail") and auth != b"Bearer " + key:
            return self.reply(401, {"error": {"message": "wrong key", "code": "invalid_api_key"}})
        if path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            self.generate(path, body)
        else:
            self.reply(*self.simple(method, path, body))

    def simple(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        eng = self.engine
        if path in ("/health", "/health_generate"):
            return (200, {}) if eng.healthy else (503, {"error": "unhealthy"})
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": eng.model, "object": "model"}]}
        if path in ("/model_info", "/get_model_info"):  # what SGLang-aware routers ask
            return 200, {"model_path": eng.model, "tokenizer_path": eng.model,
                         "is_generation": True}  # fmt: skip
        if path in ("/get_load", "/get_server_info", "/server_info"):
            return 200, {**eng.info(), "num_reqs": eng.in_flight, "stats": eng.stats}
        if path == "/fake/load":  # what /get_server_info reports as the engine's stats
            eng.stats = json.loads(body)
            return 200, {}
        if path.startswith("/v1/messages"):  # the body as received, to compare with the sent
            return 200, {"worker": eng.name, "body_sha256": hashlib.sha256(body).hexdigest()}
        if path == "/flush_cache":
            eng.blocks.clear()
            return 200, {"message": "Cache flushed"}
        if path == "/fake/fail":
            req = json.loads(body)
            eng.fail_count, eng.fail_status = req.get("count", 1), req.get("status", 500)
            eng.fail_chunked = req.get("chunked", False)
            return 200, {}
        if path == "/fake/health":
            eng.healthy = json.loads(body).get("ok", True)
            return 200, {}
        return 404, {"error": f"no route {method} {path}"}

    def generate(self, path: str, body: bytes) -> None:
        eng = self.engine
        eng.requests += 1
        if eng.fail_count > 0:
            eng.fail_count -= 1
            error = {"error": {"message": "injected failure"}}
            return self.reply(eng.fail_status, error, chunked=eng.fail_chunked)
        try:
            req = json.loads(body)
            prompt = eng.prompt_of(path, req)
        except (ValueError, KeyError, TypeError, AttributeError):
            return self.reply(400, {"error": {"message": "bad request body"}})
        cached = eng.cache(prompt)
        if req.get("stream"):
            asyncio.get_running_loop().create_task(self.stream(path, req, prompt, cached))
        elif self.token_delay:
            asyncio.get_running_loop().create_task(self.later(path, req, prompt, cached))
        else:
            text = "".join(eng.tokens(req))
            self.reply(200, {**eng.final(path, req, text, prompt, cached),
                             "request_id": self.rid.decode(),
                             "body_sha256": hashlib.sha256(body).hexdigest()})  # fmt: skip

    async def later(self, path: str, req: dict, prompt: str, cached: int) -> None:
        """A non-streamed answer after as long as generating its tokens would take."""
        eng, tokens = self.engine, self.engine.tokens(req)
        eng.in_flight += 1
        self.transport.pause_reading()  # type: ignore[union-attr]
        try:
            await asyncio.sleep(self.token_delay * len(tokens))
            self.reply(200, eng.final(path, req, "".join(tokens), prompt, cached))
        finally:
            eng.in_flight -= 1
            if self.transport is not None:
                self.transport.resume_reading()

    async def stream(self, path: str, req: dict, prompt: str, cached: int) -> None:
        eng = self.engine
        eng.in_flight += 1
        self.transport.pause_reading()  # type: ignore[union-attr]
        self.write(SSE_HEAD)
        so_far = ""
        try:
            for piece in eng.tokens(req):
                so_far += piece
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                self.write_chunk(b"data: " + json.dumps(eng.chunk(path, piece, so_far)).encode())
            self.write_chunk(b"data: [DONE]")
            self.write(b"0\r\n\r\n")
        finally:
            eng.in_flight -= 1
            if self.transport is not None:
                self.transport.resume_reading()

    def write_chunk(self, event: bytes) -> None:
        event += b"\n\n"
        self.write(b"%x\r\n%s\r\n" % (len(event), event))

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def reply(self, status: int, obj: dict, chunked: bool = False) -> None:
        data = json.dumps(obj).encode()
        if chunked:
            head = b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\n"
            self.write(head % status + b"Transfer-Encoding: chunked\r\n\r\n")
            self.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
            return
        head = b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        worker = b"X-Fake-Worker: %s\r\n\r\n" % self.engine.name.encode()
        self.write(head % (status, len(data)) + worker + data)


async def start(
    port: int = 0,
    name: str = "fake",
    model: str = "fake-model",
    token_delay_ms: float = 0.0,
    cache_chars: int = 0,
    api_key: str = "",
) -> tuple[asyncio.AbstractServer, FakeEngine, int]:
    """Listen on 127.0.0.1:`port` (0: any free port) in the running loop."""
    engine = FakeEngine(name, model, cache_chars)
    engine.api_key = api_key.encode()
    server = await asyncio.get_running_loop().create_server(
        lambda: WorkerConn(engine, token_delay_ms / 1000), "127.0.0.1", port, backlog=1024
    )
    return server, engine, server.sockets[0].getsockname()[1]


async def serve(
    port: int, name: str, model: str, token_delay_ms: float, cache: int, api_key: str = ""
) -> None:
    server, _, bound = await start(port, name, model, token_delay_ms, cache, api_key)
    print(f"READY {bound}", flush=True)
    async with server:
        await server.serve_forever()


def spawn(*flags: str) -> tuple[subprocess.Popen, str]:
    """Start this script as a process on a free loopback port; returns it and its URL once it
    listens. The caller kills it."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--port", "0", *flags], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"the fake worker did not start: {line!r}")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--name", default=f"fake-{time.monotonic_ns() % 100000}")
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--token-delay-ms", type=float, default=0.0)
    ap.add_argument("--cache-chars", type=int, default=0, help="prefix cache size (0: ample)")
    ap.add_argument("--api-key", default="", help="bearer key required but on /health")
    args = ap.parse_args()
    coro = serve(args.port, args.name, args.model, args.token_delay_ms, args.cache_chars,
                 args.api_key)  # fmt: skip
    try:
        import uvloop
    except ImportError:
        uvloop = None
    try:
        uvloop.run(coro) if uvloop else asyncio.run(coro)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
