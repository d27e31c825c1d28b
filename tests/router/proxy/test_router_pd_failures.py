"""A PD router over two prefill engines and one decode engine (real SmolLM2 engines) when a
prefill engine is killed and the router has not yet noticed (its health checks are a minute
apart): every request still gets its answer (another pair is tried), the answers are the greedy ones the fleet gave before the kill, the
router says which attempts failed, and the engines left hold no KV slot afterwards. A decode
engine killed mid-stream ends an Anthropic client's stream with the router's error event."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mooncake.engine")
pytest.importorskip("torch")
pytest.importorskip("httptools")

from tests.router.proxy.test_router_pd import PdRouter, free_port, start_engines  # noqa: E402
from tests.server.test_server_pd import _settled  # noqa: E402

STEMS = [f"Story {i}: a traveller reaches a city by the sea and" for i in range(6)]


def ask(router: PdRouter, text: str) -> tuple[int, object]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    status, obj = router.json("POST", "/generate", body)
    return status, obj.get("output_ids") if status == 200 else obj


def test_a_prefill_engine_killed_under_load_costs_no_request():
    boots = [free_port(), free_port()]
    p1, p2, decode = start_engines("prefill", "prefill", "decode", boots=boots)
    router = PdRouter("--prefill", p1.url, str(boots[0]), "--prefill", p2.url, str(boots[1]),
                      "--decode", decode.url, "--prefill-policy", "round_robin",
                      "--health-check-interval-secs", "60")  # fmt: skip
    try:
        before = {s: ask(router, s) for s in STEMS}  # both prefill engines serve (round robin)
        assert all(status == 200 for status, _ in before.values()), before
        used = {w["url"]: w["requests"] for w in router.json("GET", "/workers")[1]["workers"]}
        assert used[p1.url] > 0 and used[p2.url] > 0, used
        p1.stop(check=False, sig=signal.SIGKILL)  # the router learns it from failed attempts
        with ThreadPoolExecutor(3) as pool:
            after = list(pool.map(lambda s: ask(router, s), STEMS * 3))
        assert [a for a in after if a[0] != 200] == []
        assert [ids for _, ids in after] == [before[s][1] for s in STEMS * 3]
        failed = [ln for ln in router.lines if "failed" in ln]
        assert any(f"on {p1.url} (prefill) failed" in ln for ln in failed), failed
        assert not any("(decode) failed" in ln for ln in failed), failed
        for server in (p2, decode):
            _settled(server)
    finally:
        router.stop()
        for s in (p1, p2, decode):
            if s.proc.poll() is None:
                s.stop(check=False)


def test_a_decode_engine_killed_mid_stream_ends_an_anthropic_stream_with_its_error_event():
    """/v1/messages streamed through the pair with the `anthropic` client: the decode engine
    dies after the first text; the client's stream raises Anthropic's error event (the router's
    own, in Anthropic's shape), and the prefill engine holds no slot afterwards."""
    anthropic = pytest.importorskip("anthropic")
    boot = free_port()
    prefill, decode = start_engines("prefill", "decode", boots=[boot])
    router = PdRouter("--prefill", prefill.url, str(boot), "--decode", decode.url)
    try:
        client = anthropic.Anthropic(base_url=f"http://{router.addr}", api_key="-", max_retries=0)
        ask = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]
        stream = client.messages.create(model=decode.name, max_tokens=400, messages=ask,
                                        stream=True, extra_body={"temperature": 0})  # fmt: skip
        events = iter(stream)
        while next(events).type != "content_block_delta":
            pass
        decode.stop(check=False, sig=signal.SIGKILL)
        with pytest.raises(anthropic.APIStatusError) as e:
            for _ in events:
                pass
        error = e.value.body["error"]
        assert error["type"] == "api_error" and "mid-stream" in error["message"], e.value.body
        _settled(prefill)
    finally:
        router.stop()
        for s in (prefill, decode):
            if s.proc.poll() is None:
                s.stop(check=False)
