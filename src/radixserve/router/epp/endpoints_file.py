"""The pool's endpoints as an Envoy EDS file: the ClusterLoadAssignment a standalone Envoy's
`inference_pool` cluster reads from disk, so that its override_host load balancer knows every
endpoint the picker may name (a primary and its fallbacks), replaced whole when they change."""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
from pathlib import Path

CLUSTER = "inference_pool"  # the EDS service name deploy/envoy/envoy-epp.yaml asks for
ASSIGNMENT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def split(endpoint: str) -> tuple[str, int] | None:
    """(ip, port) of an `ip:port` or `[ipv6]:port` endpoint; None when its host is a name
    (Envoy's EDS takes addresses only)."""
    host, _, port = endpoint.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host, int(port)


def assignment(endpoints: list[str], version: int) -> dict:
    """The EDS discovery response listing `endpoints` (those named by IP) for CLUSTER."""
    hosts = [a for a in map(split, endpoints) if a is not None]
    lb = [{"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
          for h, p in hosts]  # fmt: skip
    resource = {"@type": ASSIGNMENT, "cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": lb}]}
    return {"version_info": str(version), "resources": [resource]}


def write(path: str | Path, endpoints: list[str], version: int) -> None:
    """Replace the file in one rename: Envoy watches for a file moved into place, and never
    reads a half-written one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.fchmod(fd, 0o644)  # Envoy may run as another user
    with os.fdopen(fd, "w") as f:
        json.dump(assignment(endpoints, version), f, indent=1)
    os.replace(tmp, path)
