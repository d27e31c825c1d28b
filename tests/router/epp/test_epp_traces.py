"""--enable-trace on `radixserve epp`: a real Envoy asks the EPP, which records the pick as a
`radixserve.epp` span continuing the client's traceparent, with its routing decision (policy,
worker, expected hit) under it, and sets the traceparent Envoy sends on, so that the engine's
spans join the same trace under the EPP's span. A real OTLP/HTTP receiver decodes the export."""

from __future__ import annotations

import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy")
pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytest.importorskip("opentelemetry.proto")

from envoy_harness import EnvoyProc, EppProc  # noqa: E402
from otlp_receiver import Receiver  # noqa: E402
from server_harness import ServerProcess  # noqa: E402
from test_epp_envoy import _post, _prompt, _wait_routable  # noqa: E402
from test_traces import EVENTS, SERVER, engine_spans, one, traced  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_pick_and_the_engine_join_the_clients_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    receiver = Receiver()
    procs = []
    try:
        worker = ServerProcess(["--sim", "tiny-cpu", "--max-total-tokens", "2048",
                                "--kv-events-config", EVENTS, *traced(receiver)])  # fmt: skip
        procs.append(worker)
        epp = EppProc([worker.url], "--policy", "cache_aware", *traced(receiver))
        procs.append(epp)
        envoy = EnvoyProc(epp, tmp_path)
        procs.append(envoy)
        _wait_routable(epp, 1)
        body = _prompt(1, 0)
        assert _post(envoy.addr, "/generate", body)[0] == 200  # the prefix is now in the tree
        trace_id, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
        status, _, _ = _post_traced(envoy.addr, body, f"00-{trace_id}-{client_span}-01")
        assert status == 200
        engine = engine_spans(receiver, trace_id)
        spans = receiver.wait(lambda ss: any(s.name == "radixserve.epp" and s.trace_id == trace_id
                                             for s in ss), "the EPP's span")  # fmt: skip
        root = one(spans, "radixserve.epp", trace_id)
        decision = one(spans, "radixserve.route.decision", trace_id)
        assert root.service == "radixserve-router" and root.kind == SERVER
        assert root.parent_id == client_span  # the client's trace continued
        assert decision.parent_id == root.span_id
        assert decision.attributes["radixserve.routing.policy"] == "cache_aware"
        assert decision.attributes["radixserve.routing.worker"] == worker.url
        assert decision.attributes["radixserve.routing.expected_hit_units"] > 0  # a repeat
        assert root.attributes["http.response.status_code"] == 200
        assert engine["request"].parent_id == root.span_id  # Envoy sent the EPP's traceparent
    finally:
        for proc in reversed(procs):
            proc.stop()
        receiver.close()


def _post_traced(addr: str, body: dict, traceparent: str) -> tuple[int, bytes, dict]:
    import http.client
    import json

    conn = http.client.HTTPConnection(addr, timeout=60)
    conn.request("POST", "/generate", json.dumps(body), {"traceparent": traceparent})
    resp = conn.getresponse()
    out = resp.status, resp.read(), dict(resp.getheaders())
    conn.close()
    return out
