"""`serve --sim --sim-kv-store JSON`: a simulated engine takes part in a KV store (Mooncake Store)
by writing the pages of every prompt it prefilled as small placeholder objects under the real
keys (cache.hashing.page_keys), so that routers asking the store's metadata service where a
prefix lives (`route --kv-index mooncake://`) can be tested at fleet scale with no model."""

# Off the request path: the scheduler loop hands each finished request's prompt to a bounded
# queue (a full queue drops the prompt and counts it: the store is a cache, never a reason to
# wait) and one thread writes the chunks not written yet through kvstore's backend (write-once;
# a down store is gated there, and this thread simply tries later prompts). The objects are
# placeholders of `placeholder_bytes` in the backend's framed format: their keys are real, their
# bytes are not KV (the namespace says "sim-placeholder", so no real engine could load them).
#
# Only prompts in the default cache namespace (no LoRA adapter, no cache salt) are written.

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from radixserve.cache.hashing import ALGORITHMS, KVNamespace, page_keys

log = logging.getLogger("radixserve.engine")
OWN_KEYS = ("backend", "chunk_size", "hash_algo", "seed", "placeholder_bytes", "queue")


def parse_sim_store(text: str | dict[str, Any]) -> dict[str, Any]:
    """The JSON of --sim-kv-store checked: {"backend": "mooncake" | "file", "chunk_size",
    "hash_algo", "seed", "placeholder_bytes", "queue", ...the backend's extra-config keys}."""
    try:
        cfg = dict(json.loads(text) if isinstance(text, str) else text)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--sim-kv-store is not a JSON object: {exc}") from None
    cfg.setdefault("backend", "mooncake")
    cfg.setdefault("chunk_size", 256)
    cfg.setdefault("hash_algo", "sha256_cbor")
    cfg.setdefault("seed", 0)
    cfg.setdefault("placeholder_bytes", 64)
    cfg.setdefault("queue", 1024)
    if cfg["backend"] not in ("mooncake", "file"):
        raise ValueError(f"--sim-kv-store backend must be mooncake or file, not {cfg['backend']!r}")
    if cfg["hash_algo"] not in ALGORITHMS:
        raise ValueError(f"--sim-kv-store hash_algo {cfg['hash_algo']!r}: choose from "
                         f"{sorted(ALGORITHMS)}")  # fmt: skip
    for key in ("chunk_size", "placeholder_bytes", "queue"):
        if type(cfg[key]) is not int or cfg[key] < 1:
            raise ValueError(f"--sim-kv-store {key} must be an integer >= 1, got {cfg[key]!r}")
    if type(cfg["seed"]) is not int:
        raise ValueError(f"--sim-kv-store seed must be an integer, got {cfg['seed']!r}")
    return cfg


class SimStoreWriter:
    """Writes prompts' chunks to the store in a thread of the scheduler process."""

    def __init__(self, config: dict[str, Any], preset: str, page_size: int) -> None:
        from radixserve.kvstore.backends import create_backend
        from radixserve.kvstore.storage import PageFormat

        cfg = parse_sim_store(config)
        if cfg["chunk_size"] % page_size:
            raise ValueError(f"--sim-kv-store chunk_size {cfg['chunk_size']} must be a multiple "
                             f"of the page size {page_size}")  # fmt: skip
        self.cfg = cfg
        self.namespace = KVNamespace(f"sim:{preset}", "sim-placeholder", 1, 1, 1, page_size)
        self.digest = self.namespace.digest()
        extra = {k: v for k, v in cfg.items() if k not in OWN_KEYS}
        fmt = PageFormat(self.digest, cfg["placeholder_bytes"])
        self.backend = create_backend(cfg["backend"], fmt, extra)
        self.placeholder = bytes(cfg["placeholder_bytes"])
        self.queue: queue.Queue[tuple[int, ...] | None] = queue.Queue(cfg["queue"])
        self.written: set[str] = set()  # keys this process stored (or found stored)
        self._outages = 0  # the backend's outages seen: a master restart forgets every key
        self.pages_written = self.dropped = self.failed = 0
        self.thread = threading.Thread(target=self._run, name="sim-kv-store", daemon=True)
        self.thread.start()

    def info(self) -> dict[str, Any]:
        """What a router reads from /get_server_info to compute and place this engine's keys:
        engines mount no segment (their pages live in the store process's), hence segment null."""
        return {"backend": self.cfg["backend"], "namespace": self.digest, "segment": None,
                "chunk_size": self.cfg["chunk_size"], "hash_algo": self.cfg["hash_algo"],
                "seed": self.cfg["seed"], "placeholder": True}  # fmt: skip

    def stats(self) -> dict[str, int]:
        return {"kv_store_pages_written": self.pages_written,
                "kv_store_prompts_dropped": self.dropped,
                "kv_store_write_failures": self.failed}  # fmt: skip

    def submit(self, token_ids: Sequence[int], namespace: Any = None) -> None:
        """Queue a prefilled prompt (never blocks; a full queue drops it)."""
        if namespace is not None or len(token_ids) < self.cfg["chunk_size"]:
            return
        try:
            self.queue.put_nowait(tuple(token_ids))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            ids = self.queue.get()
            if ids is None:
                return
            try:
                self._write(ids)
            except Exception as exc:  # the store must never take the engine down
                self.failed += 1
                log.warning("sim KV store write failed: %r", exc)

    def _write(self, ids: tuple[int, ...]) -> None:
        cfg = self.cfg
        outages = getattr(getattr(self.backend, "gate", None), "outages", 0)
        if outages != self._outages:  # the store was down: what it held may be gone
            self._outages = outages
            self.written.clear()
        keys = page_keys(ids, self.namespace, cfg["chunk_size"], cfg["hash_algo"], cfg["seed"])
        new = [k for k in keys if k not in self.written]
        if not new:
            return
        stored = self.backend.put_pages(new, [self.placeholder] * len(new))
        if stored == len(new):
            self.written.update(new)
            self.pages_written += len(new)
        else:
            self.failed += 1

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(5)
        self.backend.close()
