"""Worker discovery's pure parts: worker files in both forms, Kubernetes pods (as the API returns
them) to worker urls through a list or a watch's events, an InferencePool to its pods' labels and
port, and the service-discovery flags. The watch itself (router/kube.py) is tested against a
fake API server in tests/router/proxy/test_router_k8s_discovery.py."""

from __future__ import annotations

import re

import pytest

from radixserve.router.discovery import (
    DiscoveryConfig,
    apply_pod_event,
    label_selector,
    parse_worker_file,
    pod_url,
    pods_to_workers,
    pool_target,
)


def test_a_worker_file_lists_urls_a_line_with_comments():
    text = "# the pool\nhttp://10.0.0.1:8000\n\n10.0.0.2:8000  # bare host:port\nhttps://w3/\n"
    assert parse_worker_file(text) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "https://w3"]


def test_a_json_worker_file_takes_endpoints_or_a_list():
    text = '{"endpoints": [{"address": "10.0.0.1", "port": 8000}, "http://10.0.0.2:8001"]}'
    assert parse_worker_file(text) == ["http://10.0.0.1:8000", "http://10.0.0.2:8001"]
    assert parse_worker_file('["10.0.0.3:9"]') == ["http://10.0.0.3:9"]


@pytest.mark.parametrize(
    "text, says",
    [('{"pods": []}', "endpoints"), ('[{"address": "x"}]', "address"), ("ftp://x:1", "http")],
)
def test_a_malformed_worker_file_is_refused_with_the_reason(text, says):
    with pytest.raises(ValueError, match=says):
        parse_worker_file(text)


def _pod(name, ip="10.1.0.5", phase="Running", ready="True", labels=None, deleting=False):
    meta = {"name": name, "labels": labels if labels is not None else {"app": "vllm"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-28T06:00:00Z"
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


SEL = {"app": "vllm"}


def test_only_a_running_ready_matching_pod_with_an_ip_is_a_worker():
    assert pod_url(_pod("a"), 8000, SEL) == "http://10.1.0.5:8000"
    assert pod_url(_pod("a", ip="fd00::5"), 8000, SEL) == "http://[fd00::5]:8000"
    for pod in (_pod("a", ip=None), _pod("a", phase="Pending"), _pod("a", ready="False"),
                _pod("a", labels={"app": "sglang"}), _pod("a", deleting=True)):  # fmt: skip
        assert pod_url(pod, 8000, SEL) is None


def test_watch_events_add_update_and_remove_workers():
    workers = apply_pod_event({}, "ADDED", _pod("a", phase="Pending", ip=None), 8000, SEL)
    assert workers == {}  # not ready yet: no traffic
    workers = apply_pod_event(workers, "MODIFIED", _pod("a"), 8000, SEL)
    workers = apply_pod_event(workers, "ADDED", _pod("b", ip="10.1.0.6"), 8000, SEL)
    assert workers == {"a": "http://10.1.0.5:8000", "b": "http://10.1.0.6:8000"}
    workers = apply_pod_event(workers, "MODIFIED", _pod("a", ready="False"), 8000, SEL)
    assert workers == {"b": "http://10.1.0.6:8000"}  # failing its readiness probe: out
    workers = apply_pod_event(workers, "MODIFIED", _pod("b", ip="10.1.0.9"), 8000, SEL)
    assert workers == {"b": "http://10.1.0.9:8000"}  # rescheduled with a new IP
    assert apply_pod_event(workers, "BOOKMARK", {"metadata": {}}, 8000, SEL) == workers
    assert apply_pod_event(workers, "DELETED", _pod("b"), 8000, SEL) == {}


def test_pods_are_keyed_by_namespace_so_a_cluster_wide_watch_keeps_them_apart():
    a = _pod("engine-0")
    b = _pod("engine-0", ip="10.1.0.6")
    a["metadata"]["namespace"], b["metadata"]["namespace"] = "team-a", "team-b"
    assert pods_to_workers([a, b], 8000, SEL) == {
        "team-a/engine-0": "http://10.1.0.5:8000",
        "team-b/engine-0": "http://10.1.0.6:8000",
    }


def test_an_inferencepool_names_its_pods_labels_and_port_in_either_version():
    v1 = {"spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]}}
    v1alpha2 = {"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8001}}
    assert pool_target(v1) == ({"app": "vllm"}, 8000)
    assert pool_target(v1alpha2) == ({"app": "vllm"}, 8001)
    with pytest.raises(ValueError, match="InferencePool p names no label selector"):
        pool_target({"metadata": {"name": "p"}, "spec": {"targetPorts": [{"number": 8000}]}})


def test_selector_flags_are_smgs_and_refused_when_they_cannot_mean_anything():
    cfg = DiscoveryConfig(service_discovery=True, selector=("app=vllm", "role=decode"))
    assert cfg.selector_labels() == {"app": "vllm", "role": "decode"}
    assert label_selector(cfg.selector_labels()) == "app=vllm,role=decode"
    assert cfg.namespace is None  # every namespace, as smg's default
    pool = DiscoveryConfig(service_discovery=True, pool_name="llama")
    assert pool.namespace == "default"
    refused = [
        ({"selector": ("app=vllm",)}, "--selector: for --service-discovery only"),
        ({"service_discovery": True}, "one of the two"),
        ({"service_discovery": True, "selector": ("a=b",), "pool_name": "p"}, "one of the two"),
        ({"service_discovery": True, "selector": ("app",)}, "KEY=VALUE"),
        ({"service_discovery": True, "selector": ("app!=x",)}, "KEY=VALUE"),
        ({"service_discovery": True, "pool_name": "p", "service_discovery_port": 9},
         "the InferencePool names the port"),
    ]  # fmt: skip
    for kwargs, says in refused:
        with pytest.raises(ValueError, match=re.escape(says)):
            DiscoveryConfig(**kwargs)
