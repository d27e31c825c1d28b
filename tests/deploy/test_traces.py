"""--enable-trace on `route` and `serve`: a real OTLP/HTTP receiver in the test decodes what a
real router and real engines export. One trace runs client -> router (its routing decision with
the policy, the worker and the expected hit) -> engine (the HTTP request, then queue wait, prefill
and decode from the scheduler process, carried there over ZeroMQ), each span under the right
parent; the token counts on the spans are the ones the client was answered."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytest.importorskip("opentelemetry.proto")

from otlp_receiver import Receiver, Span  # noqa: E402
from server_harness import ServerProcess  # noqa: E402
from test_router_fleet import RouterProc  # noqa: E402

EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
SERVER, CLIENT = 2, 3  # OTLP's span kinds
SKEW_NS = 5_000_000  # processes stamp spans from their own reading of the wall clock


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's batch delay, in ms
    r = Receiver()
    yield r
    r.close()


def traced(r: Receiver) -> list[str]:
    return ["--enable-trace", "--otlp-traces-endpoint", r.endpoint]


def post(addr: str, body: dict, traceparent: str | None = None) -> tuple[dict, str]:
    """/generate's meta_info, and the X-Request-Id the router answered with."""
    conn = http.client.HTTPConnection(addr, timeout=60)
    headers = {"traceparent": traceparent} if traceparent else {}
    conn.request("POST", "/generate", json.dumps(body), headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.status == 200, data
    return json.loads(data)["meta_info"], resp.getheader("X-Request-Id", "")


def wait_routable(router: RouterProc, url: str) -> None:
    deadline = time.monotonic() + 30
    while not any(w["url"] == url and w["healthy"] for w in router.call("GET", "/workers")[1]["workers"]):  # fmt: skip
        assert time.monotonic() < deadline, "the worker never became routable"
        time.sleep(0.1)


def one(spans: list[Span], name: str, trace_id: str) -> Span:
    [span] = [s for s in spans if s.name == name and s.trace_id == trace_id]
    return span


def engine_spans(r: Receiver, trace_id: str) -> dict[str, Span]:
    names = ("radixserve.serve.request", "radixserve.engine.queue", "radixserve.engine.prefill",
             "radixserve.engine.decode")  # fmt: skip
    spans = r.wait(lambda ss: all(any(s.name == n and s.trace_id == trace_id for s in ss)
                                  for n in names), f"the engine's spans of {trace_id}")  # fmt: skip
    return {n.rsplit(".", 1)[1]: one(spans, n, trace_id) for n in names}


def check_engine(spans: dict[str, Span], meta: dict, parent: str) -> None:
    """Under `parent`: the request span, and under it queue, prefill and decode in order, with
    the token counts the client got."""
    req = spans["request"]
    assert req.service == "radixserve-engine" and req.kind == SERVER and req.parent_id == parent
    assert req.attributes["http.response.status_code"] == 200
    q, p, d = spans["queue"], spans["prefill"], spans["decode"]
    assert q.parent_id == p.parent_id == d.parent_id == req.span_id
    assert req.start_ns - SKEW_NS <= q.start_ns <= q.end_ns == p.start_ns <= p.end_ns
    assert p.end_ns == d.start_ns <= d.end_ns <= req.end_ns + SKEW_NS
    assert p.attributes["radixserve.prompt_tokens"] == meta["prompt_tokens"]
    assert p.attributes["radixserve.cached_tokens"] == meta["cached_tokens"]
    computed = meta["prompt_tokens"] - meta["cached_tokens"]
    assert p.attributes["radixserve.computed_tokens"] == computed
    assert d.attributes["radixserve.output_tokens"] == meta["completion_tokens"]
    assert d.attributes["radixserve.finish_reason"] == meta["finish_reason"]["type"]


@pytest.mark.slow
def test_one_trace_from_client_through_router_to_sim_engine(receiver):
    worker = ServerProcess(["--sim", "tiny-cpu", "--max-total-tokens", "2048",
                            "--kv-events-config", EVENTS, *traced(receiver)])  # fmt: skip
    routers: list[RouterProc] = []
    try:
        routers.append(RouterProc([worker.url], "--policy", "kv_aware", *traced(receiver)))
        router = routers[0]
        wait_routable(router, worker.url)
        prompt = " ".join(f"w{i}" for i in range(96))
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 6}}
        post(router.addr, body)  # the prefix is cached and its blocks reach the index
        deadline = time.monotonic() + 20
        while router.metrics().get(f"kv_index_blocks@{worker.url}", 0) < 5:
            assert time.monotonic() < deadline, "the router never indexed the prompt's blocks"
            time.sleep(0.05)
        before = router.metrics()["kv_expected_hit_tokens_total"]
        trace_id, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
        meta, _ = post(router.addr, body, f"00-{trace_id}-{client_span}-01")
        hit = router.metrics()["kv_expected_hit_tokens_total"] - before
        assert hit > 0 and meta["cached_tokens"] > 0

        engine = engine_spans(receiver, trace_id)
        spans = receiver.wait(lambda ss: any(s.name == "radixserve.route" and
                                             s.trace_id == trace_id for s in ss), "route span")  # fmt: skip
        route = one(spans, "radixserve.route", trace_id)
        decision = one(spans, "radixserve.route.decision", trace_id)
        upstream = one(spans, "radixserve.route.upstream", trace_id)
        assert route.service == "radixserve-router" and route.kind == SERVER
        assert route.parent_id == client_span  # the client's trace continued
        assert decision.parent_id == upstream.parent_id == route.span_id
        assert decision.attributes["radixserve.routing.policy"] == "kv_aware"
        assert decision.attributes["radixserve.routing.worker"] == worker.url
        assert decision.attributes["radixserve.routing.expected_hit_tokens"] == hit
        assert upstream.kind == CLIENT
        assert upstream.attributes["http.response.status_code"] == 200
        assert route.start_ns <= decision.start_ns <= decision.end_ns <= upstream.start_ns
        check_engine(engine, meta, upstream.span_id)

        # a malformed traceparent: the router starts a trace of its own, the engine joins it
        fresh = {"text": "fresh words", "sampling_params": {"max_new_tokens": 3}}
        meta, rid = post(router.addr, fresh, "not-a-traceparent")
        spans = receiver.wait(lambda ss: any(s.name == "radixserve.route" and
                                             s.attributes["radixserve.request_id"] == rid
                                             for s in ss), "a new trace's route span")  # fmt: skip
        [route] = [s for s in spans if s.name == "radixserve.route"
                   and s.attributes["radixserve.request_id"] == rid]  # fmt: skip
        assert route.parent_id == ""
        engine = engine_spans(receiver, route.trace_id)
        upstream = one(receiver.spans, "radixserve.route.upstream", route.trace_id)
        check_engine(engine, meta, upstream.span_id)

        # a client's unsampled traceparent (flags 00): neither router nor engine records it,
        # as a sampled one sent after it shows once its spans are in
        unsampled, sampled = "6bf92f3577b34da6a3ce929d0e0e4738", "7bf92f3577b34da6a3ce929d0e0e4739"
        post(router.addr, body, f"00-{unsampled}-00f067aa0ba902b9-00")
        meta, _ = post(router.addr, body, f"00-{sampled}-00f067aa0ba902ba-01")
        engine_spans(receiver, sampled)
        receiver.wait(lambda ss: any(s.name == "radixserve.route" and s.trace_id == sampled
                                     for s in ss), "the sampled trace's route span")  # fmt: skip
        assert not [s for s in receiver.spans if s.trace_id == unsampled]

        # a router that does not trace passes the client's traceparent on to the engine
        routers.append(RouterProc([worker.url]))
        wait_routable(routers[1], worker.url)
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        meta, _ = post(routers[1].addr, body, f"00-{trace_id}-00f067aa0ba902b7-01")
        check_engine(engine_spans(receiver, trace_id), meta, "00f067aa0ba902b7")
        assert not [s for s in receiver.spans if s.trace_id == trace_id and s.service !=
                    "radixserve-engine"]  # fmt: skip
        assert set(receiver.paths) == {"/v1/traces"}
    finally:
        for r in routers:
            r.stop()
        worker.stop()


@pytest.mark.slow
def test_real_engine_prefill_and_decode_spans_under_the_routers(receiver):
    worker = ServerProcess(["--max-total-tokens", "4096", *traced(receiver)])
    router = None
    try:
        router = RouterProc([worker.url], "--policy", "cache_aware", *traced(receiver))
        wait_routable(router, worker.url)
        trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
        body = {"text": "The capital of France is", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        meta, _ = post(router.addr, body, f"00-{trace_id}-00f067aa0ba902b8-01")
        engine = engine_spans(receiver, trace_id)
        upstream = one(receiver.wait(lambda ss: any(s.name == "radixserve.route.upstream"
                                                    and s.trace_id == trace_id for s in ss),
                                     "upstream span"), "radixserve.route.upstream", trace_id)  # fmt: skip
        check_engine(engine, meta, upstream.span_id)
        assert engine["prefill"].end_ns > engine["prefill"].start_ns  # a real forward took time
        assert engine["decode"].attributes["radixserve.output_tokens"] == 8
        decision = one(receiver.spans, "radixserve.route.decision", trace_id)
        assert decision.attributes["radixserve.routing.policy"] == "cache_aware"
        assert "radixserve.routing.expected_hit_units" in decision.attributes
    finally:
        if router is not None:
            router.stop()
        worker.stop()


NO_SDK = ("import sys; sys.modules['opentelemetry.sdk'] = None; from radixserve.cli import main; "
          "sys.exit(main(sys.argv[1:]))")  # fmt: skip


@pytest.mark.parametrize("command", [["route"], ["epp"], ["serve", "--sim", "tiny-cpu"]])
def test_enable_trace_without_the_extra_is_one_line(command):
    run = subprocess.run([sys.executable, "-c", NO_SDK, *command, "--enable-trace"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2
    assert "pip install 'radixserve[trace]'" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["route"], ["epp"], ["serve", "--sim", "tiny-cpu"]])
def test_endpoint_without_enable_trace_is_refused(command):
    run = subprocess.run([sys.executable, "-m", "radixserve", *command,
                          "--otlp-traces-endpoint", "127.0.0.1:4318"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "--otlp-traces-endpoint needs --enable-trace" in run.stderr


def test_nothing_imports_opentelemetry_without_enable_trace():
    """The core install (no trace extra) runs router and engine: no module of theirs imports
    the OpenTelemetry SDK or exporter (the API alone comes with FastAPI)."""
    code = ("import sys; sys.modules['opentelemetry.sdk'] = None\n"
            "sys.modules['opentelemetry.exporter'] = None\n"
            "import radixserve.router.proxy.app, radixserve.router.proxy.cli\n"
            "import radixserve.server.app, radixserve.server.cli, radixserve.engine.scheduler_proc\n"
            "from radixserve.cli import build_parser; build_parser().parse_args(['route'])")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
