"""A stand-in for the Kubernetes API server, over real HTTP in the Kubernetes wire format, for the
discovery tests: the official `kubernetes` client talks to it through a kubeconfig file. It
serves what pod discovery reads and nothing else:

- GET /api/v1/namespaces/NS/pods and /api/v1/pods: a PodList (labelSelector `k=v,...`) with
  the list's resourceVersion;
- the same with `watch=true&resourceVersion=RV`: a chunked stream of JSON lines
  `{"type": ADDED|MODIFIED|DELETED, "object": pod}` after RV, closed after timeoutSeconds; an RV
  older than the last `compact()` gets the apiserver's answer, an ERROR event whose object is a
  Status with code 410 (Gone), in a 200 stream;
- GET /apis/GROUP/VERSION/namespaces/NS/inferencepools/NAME: a stored InferencePool.

Every request must carry the kubeconfig's bearer token (else 401); each is recorded as
(verb, resource) so that a test can hold the RBAC rules to what the client really asked for.
It is not an apiserver: no admission, no field validation, no watch cache, no RBAC checks."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

TOKEN = "discovery-test-token"


def pod(name: str, ns: str, labels: dict[str, str], ip: str | None, ready: bool) -> dict[str, Any]:
    """A pod as the API returns it: Running and Ready with an IP, or Pending without one."""
    status: dict[str, Any] = {"phase": "Running" if ip else "Pending",
                              "conditions": [{"type": "Ready", "status": str(ready)}]}  # fmt: skip
    if ip:
        status.update(podIP=ip, podIPs=[{"ip": ip}])
    return {"kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": ns, "labels": labels, "uid": f"uid-{name}"},
            "spec": {"containers": [{"name": "engine", "image": "radixserve:0.1.0"}]},
            "status": status}  # fmt: skip


class FakeApi:
    """The state (pods, pools, a resourceVersion counter, the event log) and its HTTP server."""

    def __init__(self, port: int = 0) -> None:
        self.lock = threading.Condition()
        self.rv, self.compacted, self.generation, self.down = 1, 0, 0, False
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.pools: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.seen: list[tuple[str, str]] = []
        self.server: ThreadingHTTPServer | None = None
        self.start(port)

    def start(self, port: int = 0) -> None:
        self.down = False
        handler = type("Handler", (_Handler,), {"api": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", port or self.port_hint()), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def port_hint(self) -> int:
        return getattr(self, "port", 0)

    def stop(self) -> None:
        """The API server goes away: the listener closes, open watches and kept-alive
        connections are cut."""
        with self.lock:
            self.down = True
            self.generation += 1
            self.lock.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # --- changes, as the control plane would make them ---

    def put(self, p: dict[str, Any], emit: bool = True) -> None:
        """Create or update a pod; with `emit=False` the change reaches no watch (as if its
        events were compacted away before a watcher read them)."""
        key = (p["metadata"]["namespace"], p["metadata"]["name"])
        with self.lock:
            kind = "MODIFIED" if key in self.pods else "ADDED"
            self._bump(p)
            self.pods[key] = p
            if emit:
                self.events.append((self.rv, kind, p))
            self.lock.notify_all()

    def delete(self, ns: str, name: str) -> None:
        with self.lock:
            p = self.pods.pop((ns, name))
            self._bump(p)
            self.events.append((self.rv, "DELETED", p))
            self.lock.notify_all()

    def put_pool(self, group: str, ns: str, pool: dict[str, Any]) -> None:
        with self.lock:
            self.pools[(group, ns, pool["metadata"]["name"])] = pool

    def compact(self) -> None:
        """Forget every event so far and cut open watches: a watcher resuming from its last
        resourceVersion is told 410 Gone and must list again."""
        with self.lock:
            self.compacted = self.rv + 1
            self.events.clear()
            self.generation += 1
            self.lock.notify_all()

    def _bump(self, p: dict[str, Any]) -> None:
        self.rv += 1
        p["metadata"]["resourceVersion"] = str(self.rv)

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig naming this server and the token it wants."""
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                  "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
                  "users": [{"name": "router", "user": {"token": TOKEN}}],
                  "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "router"}}]}  # fmt: skip
        path.write_text(json.dumps(config))
        return path


def _matches(p: dict[str, Any], ns: str | None, selector: str) -> bool:
    labels = p["metadata"].get("labels") or {}
    wanted = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
    return (ns is None or p["metadata"]["namespace"] == ns) and all(
        labels.get(k) == v for k, v in wanted.items()
    )


class _Handler(BaseHTTPRequestHandler):
    api: FakeApi
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.api.down:  # a connection kept alive across the outage: dropped, unanswered
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = url.path.strip("/").split("/")
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._status(401, "Unauthorized", "no or wrong bearer token")
        if parts[:2] == ["api", "v1"] and parts[-1] == "pods":
            ns = parts[3] if len(parts) == 5 and parts[2] == "namespaces" else None
            watching = query.get("watch") in ("1", "t", "T", "true", "True", "TRUE")  # Go's bools
            self.api.seen.append(("watch" if watching else "list", "pods"))
            return self._watch(ns, query) if watching else self._list(ns, query)
        if parts[0] == "apis" and len(parts) == 7 and parts[5] == "inferencepools":
            self.api.seen.append(("get", f"{parts[1]}/inferencepools"))
            pool = self.api.pools.get((parts[1], parts[4], parts[6]))
            if pool is None:
                return self._status(404, "NotFound", f'inferencepools "{parts[6]}" not found')
            return self._json(200, pool)
        self._status(404, "NotFound", f"the fake API server serves no {url.path}")

    def _list(self, ns: str | None, query: dict[str, str]) -> None:
        with self.api.lock:
            items = [p for p in self.api.pods.values()
                     if _matches(p, ns, query.get("labelSelector", ""))]  # fmt: skip
            body = {"kind": "PodList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.api.rv)}, "items": items}  # fmt: skip
        self._json(200, body)

    def _watch(self, ns: str | None, query: dict[str, str]) -> None:
        since, selector = int(query.get("resourceVersion") or 0), query.get("labelSelector", "")
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with self.api.lock:
            gen = self.api.generation
            if since < self.api.compacted:
                gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                        "reason": "Expired", "message": f"too old resource version: {since}"}  # fmt: skip
                self._chunk({"type": "ERROR", "object": gone})
                return self._chunk(None)
        while time.monotonic() < deadline:
            with self.api.lock:
                fresh = [(rv, kind, p) for rv, kind, p in self.api.events
                         if rv > since and _matches(p, ns, selector)]  # fmt: skip
                if not fresh and self.api.generation == gen:
                    self.api.lock.wait(min(0.5, max(0.0, deadline - time.monotonic())))
                    continue
                if self.api.generation != gen:
                    break
            for rv, kind, p in fresh:
                self._chunk({"type": kind, "object": p})
                since = rv
        self._chunk(None)

    def _chunk(self, event: dict[str, Any] | None) -> None:
        data = b"" if event is None else json.dumps(event).encode() + b"\n"
        try:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        except OSError:
            pass

    def _json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._json(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "code": code, "reason": reason, "message": message})  # fmt: skip
