"""`radixserve route --service-discovery --selector ...`: workers found as Kubernetes pods, through
the official `kubernetes` client (the k8s extra) reading a kubeconfig. No real API server can run
on this machine (none installs from PyPI or Debian), so the client talks to tests/.../kube_fake.py
over real HTTP in the Kubernetes wire format: list, chunked watch streams, a 410 Gone ERROR event
after compaction. The workers are real `serve --sim` processes, one per loopback address, all on
the one port that --service-discovery-port names, as pods in a cluster would be."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("kubernetes")
pytest.importorskip("httptools")

from kube_fake import FakeApi, pod  # noqa: E402
from rbac import granted  # noqa: E402
from test_router_fleet import FAST_HEALTH, RouterProc, WorkerProc, load  # noqa: E402

pytestmark = pytest.mark.slow

NS, LABELS = "fleet", {"app.kubernetes.io/component": "engine", "tier": "test"}
IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def free_port_on_all(ips: tuple[str, ...]) -> int:
    """A port free on every one of these loopback addresses (one port for all pods)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = s.getsockname()[1]
        try:
            for ip in ips[1:]:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


def sim_worker(ip: str, port: int) -> WorkerProc:
    cmd = [sys.executable, "-m", "radixserve", "serve", "--sim", "tiny-cpu", "--host", ip,
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    worker = WorkerProc(cmd)
    worker.url = worker.wait_line(r"serving \S+ on (http://\S+)").group(1)
    return worker


@pytest.fixture(scope="module")
def pods_on_one_port():
    port = free_port_on_all(IPS)
    workers = [sim_worker(ip, port) for ip in IPS]
    yield port, workers
    for w in workers:
        w.stop()


@pytest.fixture
def api(tmp_path, monkeypatch):
    fake = FakeApi()
    monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: kubeconfig
    yield fake
    fake.stop()


def healthy(router: RouterProc) -> set[str]:
    return {w["url"] for w in router.call("GET", "/workers")[1]["workers"] if w["healthy"]}


def registered(router: RouterProc) -> set[str]:
    return {w["url"] for w in router.call("GET", "/workers")[1]["workers"]}


def wait(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def served(router: RouterProc, n: int) -> dict[str, int]:
    """Send n requests; all must succeed; returns the requests each worker got for them."""
    before = router.requests_per_worker()
    assert asyncio.run(load(router.addr, n, 4)) == [200] * n
    after = router.requests_per_worker()
    return {u: c - before.get(u, 0) for u, c in after.items() if c - before.get(u, 0)}


def test_pods_that_become_ready_take_traffic_and_deleted_ones_stop(pods_on_one_port, api):
    port, _ = pods_on_one_port
    a, b, c = (f"http://{ip}:{port}" for ip in IPS)
    api.put(pod("engine-a", NS, LABELS, IPS[0], ready=True))
    api.put(pod("engine-b", NS, LABELS, None, ready=False))  # scheduled, not started
    api.put(pod("other", NS, {"app.kubernetes.io/component": "redis"}, IPS[2], ready=True))
    api.put(pod("engine-x", "elsewhere", LABELS, IPS[2], ready=True))  # another namespace
    router = RouterProc([], "--service-discovery", "--selector", *(f"{k}={v}" for k, v in
                        LABELS.items()), "--service-discovery-port", str(port),
                        "--service-discovery-namespace", NS, "--policy", "round_robin",
                        *FAST_HEALTH)  # fmt: skip
    try:
        wait(lambda: healthy(router) == {a}, "the ready pod joins, the pending one does not")
        assert served(router, 8) == {a: 8}
        assert c not in registered(router)  # wrong labels, wrong namespace: never a worker

        api.put(pod("engine-b", NS, LABELS, IPS[1], ready=True))  # started, probe passed
        wait(lambda: healthy(router) == {a, b}, "a pod that becomes ready joins")
        assert set(served(router, 12)) == {a, b}

        api.put(pod("engine-a", NS, LABELS, IPS[0], ready=False))  # failing its readiness probe
        wait(lambda: registered(router) == {b}, "a pod no longer ready leaves")
        assert served(router, 6) == {b: 6}

        api.delete(NS, "engine-b")
        api.put(pod("engine-a", NS, LABELS, IPS[0], ready=True))
        wait(lambda: healthy(router) == {a}, "a deleted pod leaves, a ready one comes back")
        assert served(router, 6) == {a: 6}
    finally:
        router.stop()


def test_a_compacted_watch_lists_again_and_an_api_outage_keeps_the_workers(pods_on_one_port, api):
    """410 Gone: the change that the lost events carried is found by listing again. The API
    server down: the workers stay and serve, the router retries with backoff, and changes made
    while it was down arrive when it is back."""
    port, _ = pods_on_one_port
    a, b, c = (f"http://{ip}:{port}" for ip in IPS)
    api.put(pod("engine-a", NS, LABELS, IPS[0], ready=True))
    router = RouterProc([], "--service-discovery", "--selector", *(f"{k}={v}" for k, v in
                        LABELS.items()), "--service-discovery-port", str(port),
                        "--service-discovery-namespace", NS, *FAST_HEALTH)  # fmt: skip
    try:
        wait(lambda: healthy(router) == {a}, "the first pod joins")
        api.compact()
        api.put(pod("engine-b", NS, LABELS, IPS[1], ready=True), emit=False)
        wait(lambda: healthy(router) == {a, b}, "the pod whose events were compacted joins")
        router.wait_line(r"410 Gone", timeout=5)

        api.stop()
        router.wait_line(r"pod discovery: .*retrying in", timeout=30)
        assert registered(router) == {a, b} and set(served(router, 8)) <= {a, b}
        api.delete(NS, "engine-a")
        api.put(pod("engine-c", NS, LABELS, IPS[2], ready=True))
        api.start(api.port)
        wait(lambda: healthy(router) == {b, c}, "changes made in the outage arrive after it")
        assert set(served(router, 8)) == {b, c}
    finally:
        router.stop()
    used = set(api.seen)
    assert used == {("list", "pods"), ("watch", "pods")}
    assert used <= granted("radixserve-router"), "its Role grants what discovery asks for"


def test_the_kv_indexer_follows_the_same_pods_under_the_same_names(pods_on_one_port, api):
    """kv-indexer --service-discovery: it follows the ready pods, as http://POD_IP:PORT (the
    names the router gives them, so the shared index's entries match the router's workers)."""
    redis = pytest.importorskip("redis_harness")
    port, _ = pods_on_one_port
    a, b = (f"http://{ip}:{port}" for ip in IPS[:2])
    api.put(pod("engine-a", NS, LABELS, IPS[0], ready=True))
    api.put(pod("engine-b", NS, LABELS, IPS[1], ready=True))
    server = redis.RedisServer()
    indexer = WorkerProc([sys.executable, "-m", "radixserve", "kv-indexer", "--port", "0",
                          "--redis", server.url, "--service-discovery", "--selector",
                          *(f"{k}={v}" for k, v in LABELS.items()), "--service-discovery-port",
                          str(port), "--service-discovery-namespace", NS])  # fmt: skip
    try:
        admin = indexer.wait_line(r"admin on http://(\S+)").group(1)
        followed = lambda: set(json.loads(get(admin, "/workers"))["urls"])  # noqa: E731
        wait(lambda: followed() == {a, b}, "the indexer follows the ready pods")
        api.delete(NS, "engine-b")
        wait(lambda: followed() == {a}, "and stops following a deleted one")
    finally:
        indexer.stop()
        server.stop()
    assert set(api.seen) <= granted("radixserve-kv-indexer")


def get(addr: str, path: str) -> bytes:
    conn = http.client.HTTPConnection(addr, timeout=10)
    conn.request("GET", path)
    data = conn.getresponse().read()
    conn.close()
    return data


@pytest.mark.parametrize(
    "env,says",
    [({"KUBECONFIG": "/nonexistent/kubeconfig"}, "no in-cluster config and no kubeconfig")],
)
def test_no_cluster_config_is_one_line(env, says, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = subprocess.run([sys.executable, "-m", "radixserve", "route", "--port", "0",
                          "--service-discovery", "--selector", "app=x"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and says in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_without_the_client_the_flag_says_which_extra(tmp_path):
    """The k8s extra missing (a `kubernetes` that fails to import, first on the path): the
    one-line error names the extra."""
    (tmp_path / "kubernetes.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-m", "radixserve", "route", "--port", "0",
                          "--service-discovery", "--selector", "a=b"],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "pip install 'radixserve[k8s]'" in out.stderr and "Traceback" not in out.stderr
