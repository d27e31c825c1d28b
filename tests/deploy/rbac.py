"""What the manifests in deploy/kubernetes/ let a workload's pods ask the API server for: its
service account, the RoleBindings naming that account, the Roles they bind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def granted(workload: str) -> set[tuple[str, str]]:
    """(verb, resource) pairs the named workload's pods may use, a resource of an API group
    as GROUP/RESOURCE; empty without a service account of its own."""
    docs = _documents()
    [spec] = [d["spec"]["template"]["spec"] for d in docs
              if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == workload]  # fmt: skip
    account = spec.get("serviceAccountName")
    roles = {d["roleRef"]["name"] for d in docs if d["kind"] == "RoleBinding" and any(
        s["kind"] == "ServiceAccount" and s["name"] == account for s in d["subjects"])}  # fmt: skip
    out = set()
    for role in (d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] in roles):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    out |= {(v, f"{group}/{res}" if group else res) for v in rule["verbs"]}
    return out
