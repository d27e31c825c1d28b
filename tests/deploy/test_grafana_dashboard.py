"""deploy/grafana/: every query of the dashboard names a metric that a real router and a real
engine export. A `route --policy kv_aware` in front of a `serve --sim` worker publishing KV
events serves a few requests; both /metrics are scraped and each name the dashboard's PromQL
reads must be among the samples (a histogram's as _bucket/_sum/_count)."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from promql_names import metric_names
from server_harness import ServerProcess
from test_router_fleet import RouterProc

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "radixserve.json"
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})


def exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def scrape(host: str, port: int) -> set[str]:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_tokenizer_reads_names_not_labels_or_functions() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, worker) (rate(a_bucket{job=~"x|y"}[5m]))) / '
            'ignoring (tier) group_left sum(b_total offset 5m) > bool 0 and on (x) c')  # fmt: skip
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


def test_dashboard_is_wired_to_the_provisioned_datasource() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ds = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    [source] = ds["datasources"]
    [var] = [v for v in dash["templating"]["list"] if v["name"] == "datasource"]
    assert var["current"]["value"] == source["uid"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert all(p["targets"] for p in panels)


@pytest.mark.slow
def test_every_query_names_an_exported_metric() -> None:
    worker = ServerProcess(["--sim", "tiny-cpu", "--max-total-tokens", "2048",
                            "--kv-events-config", EVENTS])  # fmt: skip
    router = None
    try:
        router = RouterProc([worker.url], "--policy", "kv_aware")
        deadline = time.monotonic() + 30
        prompt = " ".join(f"w{i}" for i in range(96))
        for i in range(4):  # repeats of a prefix: cached tokens, KV events, index blocks
            body = {"text": prompt + f" q{i}", "sampling_params": {"max_new_tokens": 4}}
            while (status := router.call("POST", "/generate", body)[0]) == 503:
                assert time.monotonic() < deadline, "the worker never became routable"
                time.sleep(0.2)
            assert status == 200
        host, port = router.addr.rsplit(":", 1)
        exported = scrape(worker.host, worker.port)
        while not {
            "radixserve_router_worker_kv_events_lag_seconds",
            "radixserve_router_kv_index_blocks",
        } <= (got := scrape(host, int(port))):
            assert time.monotonic() < deadline, "the router never reported its index"
            time.sleep(0.2)
        exported |= got
        queries = exprs()
        assert len(queries) >= 30
        for expr in queries:
            names = metric_names(expr)
            assert names, f"no metric name read in {expr!r}"
            missing = names - exported
            assert not missing, f"{expr!r} reads {sorted(missing)}, not exported"
    finally:
        if router is not None:
            router.stop()
        worker.stop()
