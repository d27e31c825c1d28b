"""Kubernetes pod discovery's I/O, through the official `kubernetes` client (the k8s extra):
list, then watch, the pods that --selector or an InferencePool names, in a thread of its own;
each change of the ready set goes to `publish` as the set of worker urls. The pod -> worker
translation is router/discovery.py's (pure); joining and leaving is router/follow.py's."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from radixserve.router.discovery import (
    POOL_VERSIONS,
    DiscoveryConfig,
    apply_pod_event,
    label_selector,
    pods_to_workers,
    pool_target,
)

log = logging.getLogger("radixserve.router.discovery")

MISSING = "--service-discovery needs the kubernetes client: pip install 'radixserve[k8s]'"


def api_client() -> Any:
    """A client configured as smg's: in a pod, its service account (in-cluster config); else
    KUBECONFIG or ~/.kube/config. Raises ValueError (one line) when neither is there."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ValueError(MISSING) from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise ValueError(f"--service-discovery: no in-cluster config and no kubeconfig "
                             f"({exc})") from None  # fmt: skip
    return client.ApiClient()


class PodWatcher:
    """List the pods, publish the ready ones, then watch from the list's resourceVersion and
    publish each change; a watch that expires (the server closes it) or is told 410 Gone (the
    version was compacted away) lists again, and any other failure (the API server down, a
    refused call) is retried with exponential backoff, the workers left as they were."""

    def __init__(
        self, client: Any, config: DiscoveryConfig, publish: Callable[[set[str]], None],
        watch_secs: int = 240, backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:  # fmt: skip
        from kubernetes import client as k8s

        self.core, self.custom = k8s.CoreV1Api(client), k8s.CustomObjectsApi(client)
        self.config, self.publish, self.watch_secs, self.backoff = (
            config,
            publish,
            watch_secs,
            backoff,
        )
        self.stop = threading.Event()
        self.workers: dict[str, str] = {}
        self.published: set[str] | None = None

    def start(self) -> None:
        threading.Thread(target=self.run, name="k8s-pod-discovery", daemon=True).start()

    def run(self) -> None:
        delay = self.backoff[0]
        while not self.stop.is_set():
            try:
                self.list_and_watch()
                delay = self.backoff[0]
            except Exception as exc:  # noqa: BLE001  (the client's, urllib3's, a bad pool)
                if getattr(exc, "status", None) == 410:
                    log.info("pod watch: 410 Gone (resourceVersion compacted), listing again")
                    delay = self.backoff[0]
                    continue
                log.warning("pod discovery: %s; retrying in %.1f s (workers unchanged)",
                            _one_line(exc), delay)  # fmt: skip
                self.stop.wait(delay)
                delay = min(delay * 2, self.backoff[1])

    def list_and_watch(self) -> None:
        """List, then watch from the list's resourceVersion, resuming each expired watch where
        it stopped, until the target changes (an InferencePool edited), 410 Gone or a failure."""
        labels, port = self.target()
        listing = self._list(labels)
        self._set(pods_to_workers(listing.get("items") or [], port, labels))
        version = listing["metadata"]["resourceVersion"]
        while not self.stop.is_set():
            began = time.monotonic()
            version = self._watch(labels, port, version)
            if time.monotonic() - began < 1.0:  # a server that ends watches at once: no spinning
                self.stop.wait(1.0)
            if self.config.pool_name and self.target() != (labels, port):
                log.info("InferencePool %s changed, listing again", self.config.pool_name)
                return

    def _watch(self, labels: dict[str, str], port: int, version: str) -> str:
        """One watch, until the server ends it; returns the last resourceVersion seen."""
        from kubernetes import watch

        stream = watch.Watch()
        events = stream.stream(
            *self._lister(), label_selector=label_selector(labels), resource_version=version,
            timeout_seconds=self.watch_secs, allow_watch_bookmarks=True,
            _request_timeout=(10, self.watch_secs + 30),
        )  # fmt: skip
        for event in events:
            if self.stop.is_set():
                stream.stop()
                break
            obj = event["raw_object"]  # the pod as sent (deserialize=False would lose 410s)
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            self._set(apply_pod_event(self.workers, event["type"], obj, port, labels))
        return version

    def target(self) -> tuple[dict[str, str], int]:
        """The labels and port to follow: --selector's, or the InferencePool's as it is now."""
        cfg = self.config
        if not cfg.pool_name:
            return cfg.selector_labels(), cfg.service_discovery_port
        pool = self.custom.get_namespaced_custom_object(
            cfg.pool_group, POOL_VERSIONS[cfg.pool_group], cfg.namespace, "inferencepools",
            cfg.pool_name,
        )  # fmt: skip
        return pool_target(pool)

    def _lister(self) -> tuple[Any, ...]:
        ns = self.config.namespace
        if ns is None:
            return (self.core.list_pod_for_all_namespaces,)
        return (self.core.list_namespaced_pod, ns)

    def _list(self, labels: dict[str, str]) -> dict[str, Any]:
        """The pod list as the API sends it (a dict, not the client's models)."""
        func, *args = self._lister()
        resp = func(*args, label_selector=label_selector(labels), _preload_content=False,
                    _request_timeout=(10, 60))  # fmt: skip
        if not 200 <= resp.status < 300:
            raise RuntimeError(f"listing pods: HTTP {resp.status}")
        return json.loads(resp.data)

    def _set(self, workers: dict[str, str]) -> None:
        self.workers = workers
        urls = set(workers.values())
        if urls != self.published:
            self.published = urls
            self.publish(urls)


def _one_line(exc: BaseException) -> str:
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if status == 403:  # the usual first-deployment mistake: say what the Role must grant
        return "HTTP 403 Forbidden (RBAC: get, list, watch on pods; get on the InferencePool)"
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
