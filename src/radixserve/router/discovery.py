"""Finding workers as operators list them, as pure functions: a worker file's text -> urls, a
Kubernetes pod -> its worker url (or none while it is not ready), a pod watch event -> the new
set, an InferencePool -> its selector and port; and the service-discovery flags (smg's names).
The I/O (reading the file when it changes, the Kubernetes client's watch) is the caller's."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from radixserve.config import check_fields

# The Gateway API Inference Extension's InferencePool, by API group: the released v1 and the
# pre-release v1alpha2 (whose selector is a plain label map and whose port a single number).
POOL_VERSIONS = {"inference.networking.k8s.io": "v1", "inference.networking.x-k8s.io": "v1alpha2"}


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Kubernetes pod discovery, with sglang-router's (smg's) flag names; nested whole into
    RouterConfig, so `route` and `epp` share the flags."""

    service_discovery: bool = _f(
        False,
        "find workers as Kubernetes pods (the k8s extra): the ready pods that --selector or the "
        "InferencePool --pool-name selects join, pods that stop being ready or go away leave; "
        "in-cluster config, else KUBECONFIG or ~/.kube/config; RBAC: get, list, watch on pods",
    )
    selector: tuple[str, ...] = _f(
        (), "service discovery: labels the worker pods carry, all of them", metavar="KEY=VALUE"
    )
    service_discovery_port: int = _f(
        80, "service discovery: the port the workers listen on in their pods", ge=1, le=65535
    )
    service_discovery_namespace: str | None = _f(
        None,
        "service discovery: the namespace watched (default: every namespace, which needs a "
        "ClusterRole; with --pool-name: the pool's namespace, default 'default')",
    )
    pool_name: str | None = _f(
        None,
        "service discovery: follow this InferencePool (its selector and first target port) "
        "instead of --selector; read again each time a watch expires, every 4 minutes (RBAC: "
        "get on inferencepools too)",
    )
    pool_group: str = _f(
        "inference.networking.k8s.io",
        "service discovery: the InferencePool's API group",
        choices=tuple(POOL_VERSIONS),
    )

    def __post_init__(self) -> None:
        check_fields(self)
        object.__setattr__(self, "selector", tuple(self.selector or ()))
        if not self.service_discovery:
            defaults = {f.name: f.default for f in fields(self)}
            set_ = ["--" + f.name.replace("_", "-") for f in fields(self)
                    if getattr(self, f.name) != defaults[f.name]]  # fmt: skip
            if set_:
                raise ValueError(f"{', '.join(set_)}: for --service-discovery only")
            return
        if bool(self.selector) == bool(self.pool_name):
            raise ValueError("--service-discovery: give the pods' labels (--selector KEY=VALUE "
                             "...) or an InferencePool (--pool-name NAME), one of the two")  # fmt: skip
        if self.pool_name and self.service_discovery_port != 80:
            raise ValueError("--service-discovery-port: the InferencePool names the port")
        self.selector_labels()  # a malformed entry is a one-line error now

    def selector_labels(self) -> dict[str, str]:
        """--selector as {label: value}."""
        return dict(parse_label(entry) for entry in self.selector)

    @property
    def namespace(self) -> str | None:
        """The namespace watched (None: every one); a pool's is 'default' unless given."""
        if self.pool_name and self.service_discovery_namespace is None:
            return "default"
        return self.service_discovery_namespace


def parse_label(entry: str) -> tuple[str, str]:
    """One --selector entry, KEY=VALUE (equality only, as smg's)."""
    key, sep, value = entry.partition("=")
    if not sep or not key or "," in entry or key.endswith("!"):
        raise ValueError(f"--selector takes KEY=VALUE entries, not {entry!r}")
    return key, value


def label_selector(labels: Mapping[str, str]) -> str:
    """The API's labelSelector query for these labels (`k=v,k2=v2`)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def pool_target(pool: Mapping[str, Any]) -> tuple[dict[str, str], int]:
    """An InferencePool (as the API returns it) -> the labels its pods carry and the port they
    serve on: v1's `selector.matchLabels` and first `targetPorts` number, or v1alpha2's plain
    `selector` map and `targetPortNumber`. Raises ValueError on a pool that names neither."""
    spec = pool.get("spec") or {}
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels") if "matchLabels" in selector else selector
    ports = spec.get("targetPorts") or []
    port = ports[0].get("number") if ports else spec.get("targetPortNumber")
    if not labels or not isinstance(labels, Mapping) or not isinstance(port, int):
        name = (pool.get("metadata") or {}).get("name", "?")
        raise ValueError(f"InferencePool {name} names no label selector and target port")
    return {str(k): str(v) for k, v in labels.items()}, port


def parse_worker_file(text: str) -> list[str]:
    """The worker urls a worker file lists. Two forms: one url (or `host:port`) a line, `#`
    comments and blank lines skipped; or JSON, a list of urls or of `{"address", "port"}`
    objects, or an object whose `endpoints` (or `workers`) is such a list. Raises ValueError
    naming what is wrong."""
    stripped = text.strip()
    if stripped.startswith(("[", "{")):
        return _from_json(json.loads(stripped))
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [_url(line) for line in lines if line]


def _from_json(data: Any) -> list[str]:
    if isinstance(data, Mapping):
        key = "endpoints" if "endpoints" in data else "workers"
        if key not in data:
            raise ValueError('a JSON worker file is a list or has "endpoints" or "workers"')
        data = data[key]
    if not isinstance(data, list):
        raise ValueError("the worker list is not a list")
    return [_entry(item) for item in data]


def _entry(item: Any) -> str:
    if isinstance(item, str):
        return _url(item)
    if isinstance(item, Mapping) and "address" in item and "port" in item:
        return _url(f"{item['address']}:{int(item['port'])}")
    raise ValueError(f'a worker is a url or {{"address", "port"}}, not {item!r}')


def _url(entry: str) -> str:
    entry = entry.strip()
    if "://" not in entry:
        entry = "http://" + entry
    if not entry.startswith(("http://", "https://")):
        raise ValueError(f"not an http(s) worker: {entry!r}")
    return entry.rstrip("/")


def selector_matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """An equality label selector (smg's `--selector k=v ...`) matches these labels."""
    return all(labels.get(k) == v for k, v in selector.items())


def pod_url(pod: Mapping[str, Any], port: int, selector: Mapping[str, str]) -> str | None:
    """The worker url of a pod (as the Kubernetes API returns it, a dict), or None while it
    should get no traffic: labels not matching, no IP yet, not Running, not Ready, or being
    deleted."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if not selector_matches(meta.get("labels") or {}, selector):
        return None
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])  # fmt: skip
    ip = status.get("podIP")
    if not ready or not ip:
        return None
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def apply_pod_event(
    workers: Mapping[str, str], event: str, pod: Mapping[str, Any], port: int,
    selector: Mapping[str, str],
) -> dict[str, str]:  # fmt: skip
    """Pod -> worker url after one watch event (ADDED, MODIFIED, DELETED); a pod that stops
    being ready leaves, one that becomes ready joins, a BOOKMARK changes nothing. Pods are keyed
    by `namespace/name` (by name alone when the pod names no namespace)."""
    name = pod_key(pod)
    out = dict(workers)
    if event == "BOOKMARK":
        return out
    url = None if event == "DELETED" else pod_url(pod, port, selector)
    if url is None:
        out.pop(name, None)
    else:
        out[name] = url
    return out


def pod_key(pod: Mapping[str, Any]) -> str:
    """`namespace/name`: unique over a watch of every namespace."""
    meta = pod.get("metadata") or {}
    ns, name = meta.get("namespace"), meta.get("name", "")
    return f"{ns}/{name}" if ns else name


def pods_to_workers(
    pods: list[Mapping[str, Any]], port: int, selector: Mapping[str, str]
) -> dict[str, str]:
    """Pod -> worker url for a full list (the start of a watch, or a resync after 410 Gone)."""
    out: dict[str, str] = {}
    for pod in pods:
        out = apply_pod_event(out, "ADDED", pod, port, selector)
    return out
