"""`radixserve epp --service-discovery --pool-name NAME`: the EPP reads the InferencePool (its
selector and target port) and follows the pods it selects, through the official `kubernetes`
client, against tests/router/proxy/kube_fake.py (a fake API server in the Kubernetes wire
format; no real one runs here). Picks, asked over ext_proc as Envoy asks, name the pods that are
ready and never one that was deleted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("grpc")
pytest.importorskip("kubernetes")

import grpc  # noqa: E402

from envoy_harness import EppProc  # noqa: E402
from kube_fake import FakeApi, pod  # noqa: E402
from radixserve.router.epp import protocol as p  # noqa: E402
from rbac import granted  # noqa: E402
from test_router_fleet import FAST_HEALTH  # noqa: E402
from test_router_k8s_discovery import IPS, free_port_on_all, sim_worker, wait  # noqa: E402

pytestmark = pytest.mark.slow

NS, GROUP = "fleet", "inference.networking.k8s.io"
ENGINE = {"app.kubernetes.io/component": "engine"}


def pool(port: int) -> dict:
    return {"apiVersion": f"{GROUP}/v1", "kind": "InferencePool",
            "metadata": {"name": "radixserve", "namespace": NS},
            "spec": {"selector": {"matchLabels": ENGINE}, "targetPorts": [{"number": port}],
                     "endpointPickerRef": {"name": "radixserve-epp", "port": {"number": 9002}}}}  # fmt: skip


def pick(epp: EppProc) -> str:
    """The endpoint the EPP picks for one request, asked over gRPC as Envoy asks (the header
    lists the pick first, then fallbacks for Envoy's retries)."""
    body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 2}}).encode()
    headers = p.core.HeaderMap(headers=[p.core.HeaderValue(key=":path", raw_value=b"/generate"),
                                        p.core.HeaderValue(key=":method", raw_value=b"POST")])  # fmt: skip
    first = p.pb.ProcessingRequest(request_headers=p.pb.HttpHeaders(headers=headers))
    last = p.pb.ProcessingRequest(request_body=p.pb.HttpBody(body=body, end_of_stream=True))
    with grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
        stub = p.services.ExternalProcessorStub(channel)
        head = list(stub.Process(iter([first, last]), timeout=10))[0]
    mutation = head.request_headers.response.header_mutation.set_headers
    named = next(h.header.raw_value.decode() for h in mutation if h.header.key == p.DESTINATION)
    return named.split(",")[0]


def test_the_epp_follows_the_pods_of_its_inferencepool(tmp_path, monkeypatch):
    port = free_port_on_all(IPS[:2])
    workers = [sim_worker(ip, port) for ip in IPS[:2]]
    api = FakeApi()
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api.put_pool(GROUP, NS, pool(port))
    api.put(pod("engine-a", NS, ENGINE, IPS[0], ready=True))
    api.put(pod("engine-b", NS, ENGINE, None, ready=False))
    a, b = (f"{ip}:{port}" for ip in IPS[:2])
    epp = EppProc([], "--service-discovery", "--pool-name", "radixserve",
                  "--service-discovery-namespace", NS, "--policy", "round_robin", *FAST_HEALTH)  # fmt: skip
    healthy = lambda: {u for u, w in epp.workers().items() if w["healthy"]}  # noqa: E731
    try:
        wait(lambda: healthy() == {f"http://{a}"}, "the pool's ready pod joins")
        assert {pick(epp) for _ in range(4)} == {a}
        api.put(pod("engine-b", NS, ENGINE, IPS[1], ready=True))
        wait(lambda: healthy() == {f"http://{a}", f"http://{b}"}, "a pod that becomes ready joins")
        assert {pick(epp) for _ in range(6)} == {a, b}
        api.delete(NS, "engine-a")
        wait(lambda: set(epp.workers()) == {f"http://{b}"}, "a deleted pod leaves")
        assert {pick(epp) for _ in range(4)} == {b}
    finally:
        for proc in (epp, *workers):
            proc.stop()
        api.stop()
    used = set(api.seen)
    assert used == {("get", f"{GROUP}/inferencepools"), ("list", "pods"), ("watch", "pods")}
    assert used <= granted("radixserve-epp"), "the EPP's Role grants what discovery asks for"
