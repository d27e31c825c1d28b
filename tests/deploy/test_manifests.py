"""deploy/kubernetes/: every manifest validates offline against the Kubernetes schemas
(kubernetes-validate, strict: no unknown field); custom resources (the InferencePool) against a
JSON schema derived from their CRD; every radixserve command line in them parses with
radixserve's own argparse, checks included (so no flag can rot), as does the Mooncake master's
with its binary; and every address a command names is a Service of the manifests on a port it
exposes, selecting the pods that listen there."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

from radixserve.cli import build_parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES = "1.33.0"  # the oldest minor the manifests are checked against
CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"):
               Path(__file__).with_name("inferencepool_v1.schema.json")}  # fmt: skip
POD_IP = "10.1.2.3"  # what $(POD_IP) expands to in a pod


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.relative_to(ROOT)}:{doc['kind']}/{doc['metadata']['name']}",
                            doc))  # fmt: skip
    return out


def workloads() -> list[tuple[str, dict[str, Any]]]:
    kinds = ("Deployment", "StatefulSet", "DaemonSet")
    return [(where, d) for where, d in documents() if d["kind"] in kinds]


def command_lines() -> list[tuple[str, list[str]]]:
    """Each radixserve-image container's command + args, $(VAR) expanded from its env as the
    kubelet does (Redis's image is Redis's own)."""
    out = []
    for where, doc in workloads():
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if not c["image"].startswith("radixserve:"):
                continue
            env = {e["name"]: e.get("value", POD_IP) for e in c.get("env", [])}
            argv = [*c.get("command", []), *c.get("args", [])]
            argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]  # noqa: B023
            out.append((f"{where}/{c['name']}", argv))
    return out


def test_manifests_are_found() -> None:
    kinds = {d["kind"] for _, d in documents()}
    assert {"Deployment", "StatefulSet", "Service"} <= kinds
    assert any(argv[:2] == ["radixserve", "serve"] for _, argv in command_lines())


@pytest.mark.parametrize("where,doc", documents(), ids=lambda v: v if isinstance(v, str) else "")
def test_validates_against_its_schema(where: str, doc: dict[str, Any]) -> None:
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        jsonschema.validate(doc, json.loads(crd.read_text()))
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validator_refuses_a_broken_manifest() -> None:
    """The offline schemas are really read: a wrong type and an unknown field are refused."""
    _, doc = next(w for w in workloads() if w[1]["kind"] == "Deployment")
    bad = json.loads(json.dumps(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "http"}]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)
    bad = json.loads(json.dumps(doc))
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)


@pytest.mark.parametrize(
    "where,argv", command_lines(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_command_line_parses(where: str, argv: list[str]) -> None:
    if argv[0] == "radixserve":
        try:
            args = build_parser().parse_args(argv[1:])  # runs each config's checks too
        except SystemExit as e:
            pytest.fail(f"{where}: {' '.join(argv)} does not parse (exit {e.code})")
        assert args.command == argv[1]
    elif argv[0] == "mooncake_master":
        binary = shutil.which("mooncake_master")
        if binary is None:
            pytest.skip("mooncake_master is not installed (the mooncake extra)")
        known = subprocess.run([binary, "--helpfull"], capture_output=True, text=True).stdout
        for flag in argv[1:]:
            name = flag.lstrip("-").split("=")[0]
            assert re.search(rf"^\s+-{name} ", known, re.M), f"{where}: no flag {flag}"
    else:
        pytest.fail(f"{where}: {argv[0]} is neither radixserve nor mooncake_master")


def services() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == "Service"}


def pods_of(service: dict[str, Any]) -> list[dict[str, Any]]:
    """The workloads whose pods the Service selects."""
    sel = service["spec"]["selector"].items()
    return [d for _, d in workloads() if sel <= d["spec"]["template"]["metadata"]["labels"].items()]


def test_services_select_pods_that_listen_on_their_ports() -> None:
    for name, svc in services().items():
        [workload] = pods_of(svc)
        ports = {p["name"]: p["containerPort"] for c in
                 workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}  # fmt: skip
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {name}: no container port {p['targetPort']}"


ADDRESS = re.compile(r"(?:https?|redis)://([a-z0-9.-]+):(\d+)|^--[\w-]+=([a-z][a-z0-9.-]*):(\d+)$")


def test_every_address_in_a_command_is_a_service_port() -> None:
    """http://radixserve-engine-0.radixserve-engine:30000 names pod 0 of the StatefulSet behind
    the headless Service radixserve-engine; redis://radixserve-redis:6379 the Service itself."""
    svcs, seen = services(), 0
    for where, argv in command_lines():
        for arg in argv:
            for m in ADDRESS.finditer(arg):
                host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
                labels = host.split(".")
                svc = svcs.get(labels[0]) or svcs.get(labels[1] if len(labels) > 1 else "")
                assert svc is not None, f"{where}: {host} is no Service of the manifests"
                assert int(port) in {p["port"] for p in svc["spec"]["ports"]}, f"{where}: {arg}"
                if svc["metadata"]["name"] != labels[0]:  # a StatefulSet pod's own name
                    [sts] = pods_of(svc)
                    ordinal = int(labels[0].rsplit("-", 1)[1])
                    assert sts["kind"] == "StatefulSet" and ordinal < sts["spec"]["replicas"]
                    assert svc["spec"]["clusterIP"] == "None", "pod names need a headless Service"
                seen += 1
    assert seen >= 5


def test_each_server_listens_on_its_container_port() -> None:
    for where, doc in workloads():
        for c in doc["spec"]["template"]["spec"]["containers"]:
            argv = [*c.get("command", []), *c.get("args", [])]
            ports = [int(a.split("=")[1]) for a in argv if re.match(r"--(port|rpc_port)=", a)]
            declared = {p["containerPort"] for p in c.get("ports", [])}
            assert set(ports) <= declared, f"{where}: listens on {ports}, declares {declared}"


def test_scraped_pods_name_the_jobs_the_dashboard_reads() -> None:
    """deploy/grafana/prometheus-kubernetes.yml names each job radixserve-<component>: the
    dashboard's router_job and engine_job defaults are components annotated for scraping."""
    dash = json.loads((ROOT / "deploy/grafana/dashboards/radixserve.json").read_text())
    wanted = {
        v["current"]["value"] for v in dash["templating"]["list"] if v["name"].endswith("_job")
    }
    scraped = {}
    for _, d in workloads():
        meta = d["spec"]["template"]["metadata"]
        if meta.get("annotations", {}).get("prometheus.io/scrape") == "true":
            port = int(meta["annotations"]["prometheus.io/port"])
            ports = {p["containerPort"] for c in d["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", [])}  # fmt: skip
            assert port in ports, f"{d['metadata']['name']} is scraped on {port}, not a port"
            scraped["radixserve-" + meta["labels"]["app.kubernetes.io/component"]] = port
    assert wanted <= set(scraped)
    config = yaml.safe_load((ROOT / "deploy/grafana/prometheus-kubernetes.yml").read_text())
    [job] = config["scrape_configs"]
    naming = [r for r in job["relabel_configs"] if r.get("target_label") == "job"]
    assert naming == [{"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
                       "replacement": "radixserve-$1", "target_label": "job"}]  # fmt: skip


def test_inferencepool_schema_reads_the_v1_shape() -> None:
    """The schema the EPP's InferencePool will be checked against (kubernetes-validate has no
    CRDs): the v1 shape passes; a missing picker port, the pre-release field name (extensionRef)
    or a bad failure mode does not."""
    schema = json.loads(
        CRD_SCHEMAS[("inference.networking.k8s.io/v1", "InferencePool")].read_text()
    )
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "radixserve"},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/component": "engine"}},
                     "targetPorts": [{"number": 30000}],
                     "endpointPickerRef": {"name": "radixserve-epp", "port": {"number": 9002},
                                           "failureMode": "FailClose"}}}  # fmt: skip
    jsonschema.validate(pool, schema)
    spec = pool["spec"]
    for broken in ({**spec, "endpointPickerRef": {"name": "radixserve-epp"}},
                   {**spec, "extensionRef": spec["endpointPickerRef"]},
                   {**spec, "endpointPickerRef": {**spec["endpointPickerRef"], "failureMode": "Open"}}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**pool, "spec": broken}, schema)


def test_the_inferencepool_selects_the_engines_and_points_at_the_epp() -> None:
    """The pool's selector picks the engine pods, its target port is theirs, its picker is the
    EPP's Service on the port the EPP serves ext_proc on; the EPP follows this pool (pod
    discovery, --pool-name) in its own namespace, and its probes ask its gRPC health."""
    [pool] = [d for _, d in documents() if d["kind"] == "InferencePool"]
    engines = [d for _, d in workloads()
               if pool["spec"]["selector"]["matchLabels"].items()
               <= d["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
    assert [d["metadata"]["name"] for d in engines] == ["radixserve-engine"]
    engine_ports = {p["containerPort"] for p in
                    engines[0]["spec"]["template"]["spec"]["containers"][0]["ports"]}  # fmt: skip
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= engine_ports
    ref = pool["spec"]["endpointPickerRef"]
    svc = services()[ref["name"]]
    [epp] = pods_of(svc)
    [container] = epp["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "epp" and ref["port"]["number"] == args.grpc_port
    assert ref["port"]["number"] in {p["port"] for p in svc["spec"]["ports"]}
    assert container["readinessProbe"]["grpc"]["port"] == args.grpc_port
    assert args.service_discovery and args.pool_name == pool["metadata"]["name"]
    assert args.pool_group == pool["apiVersion"].split("/")[0]


def test_discovering_workloads_may_watch_pods_in_their_own_namespace() -> None:
    """Each command with --service-discovery watches the namespace its pod runs in (the
    downward API's metadata.namespace), under a service account whose Role grants get, list and
    watch on pods (and get on the InferencePool it follows); engines are found by the labels
    the engine pods carry, on the port they listen on."""
    from rbac import granted

    engine_labels = next(d for _, d in workloads() if d["metadata"]["name"] == "radixserve-engine")[
        "spec"]["template"]["metadata"]["labels"]  # fmt: skip
    found = 0
    for _, doc in workloads():
        for c in doc["spec"]["template"]["spec"]["containers"]:
            argv = c.get("args", [])
            if "--service-discovery" not in argv:
                continue
            found += 1
            env = {e["name"]: e for e in c.get("env", [])}
            assert "--service-discovery-namespace=$(POD_NAMESPACE)" in argv
            assert (
                env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
            )
            args = build_parser().parse_args(argv)
            wanted = {("get", "pods"), ("list", "pods"), ("watch", "pods")}
            if args.pool_name:
                wanted.add(("get", f"{args.pool_group}/inferencepools"))
            else:
                selector = dict(e.split("=", 1) for e in args.selector)
                assert selector.items() <= engine_labels.items()
                assert args.service_discovery_port == 30000
            assert wanted <= granted(doc["metadata"]["name"]), doc["metadata"]["name"]
    assert found == 3  # the router, the KV indexer, the EPP
