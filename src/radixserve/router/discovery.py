"""Finding workers as operators list them, as pure functions: a worker file's text -> urls, a
Kubernetes pod -> its worker url (or none while it is not ready), a pod watch event -> the new
set. The I/O (reading the file when it changes, the Kubernetes client's watch) is the caller's."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


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
    """Pod name -> worker url after one watch event (ADDED, MODIFIED, DELETED); a pod that
    stops being ready leaves, one that becomes ready joins, a BOOKMARK changes nothing."""
    name = (pod.get("metadata") or {}).get("name", "")
    out = dict(workers)
    if event == "BOOKMARK":
        return out
    url = None if event == "DELETED" else pod_url(pod, port, selector)
    if url is None:
        out.pop(name, None)
    else:
        out[name] = url
    return out
