"""The `mooncake` storage backend: pages in Mooncake Store through its Python client, the values
living in the segment of a store process (`radixserve kv-store`) that outlives every engine."""

# Facts of Mooncake Store 0.3.13 that shape this file (measured on this machine):
# - An engine's client mounts no segment of its own (global_segment_size 0): an object lives in
#   the segment of the process that holds it and vanishes with it, so pages go to the store
#   process, never into an engine that may exit.
# - put of an existing key returns 0 and keeps the old value: write-once for free.
# - A missing key is -704 from get_into (b'' from get); a holder that died leaves its keys listed
#   until client_ttl and reads fail (-800): both are a miss, the page is recomputed.
# - With the master hung (SIGSTOP) a call waits MC_RPC_TIMEOUT_MS (set from rpc_timeout_ms, read
#   at setup) and returns -901.
# - With the master down every call returns -900 after ~4.3 s of reconnecting, and setup() takes
#   ~90 s to give up: so a failure marks the service down (DownGate) and no call is made until
#   the down duration has passed; before a (re)connect the master's RPC port is probed with a
#   plain TCP connect, so a dead master costs milliseconds, not minutes. The client reconnects by
#   itself once the master is back; the master restarts empty and the store process remounts.
# - Bytes move through one registered staging buffer (batch_put_from / batch_get_into): values
#   are header + page, and the header is checked before a payload is copied out.

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

from radixserve.kvstore.gate import DownGate
from radixserve.kvstore.storage import Buffer, PageFormat, StorageBackend, take_options

log = logging.getLogger("radixserve.kvstore")

SERVICE_DOWN = {-900, -901, -1}  # RPC_FAIL, RPC_TIMEOUT, INTERNAL_ERROR: the master is unreachable
NOT_FOUND, BUFFER_TOO_SMALL = -704, -600
DEFAULTS = {
    "master_server_address": None,  # "127.0.0.1:PORT" of mooncake_master's RPC
    "local_hostname": "127.0.0.1",
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "device_name": "",
    "global_segment_size": 0,
    "local_buffer_size": 0,
    "te_port_range": None,  # "LOW-HIGH" -> MC_MIN_RPC_PORT / MC_MAX_RPC_PORT (below 32768)
    "client_port_range": None,  # "LOW-HIGH" -> MC_STORE_CLIENT_MIN_PORT / MAX_PORT
    "down_duration_s": 30.0,
    "rpc_timeout_ms": 2000,  # MC_RPC_TIMEOUT_MS: a hung master costs this, not Mooncake's 30 s
    "batch_pages": 64,
}


def _range_env(value: str | None, low_var: str, high_var: str) -> dict[str, str]:
    if value is None:
        if low_var not in os.environ or high_var not in os.environ:
            raise ValueError(f"mooncake backend: set the port range (extra-config or {low_var}/"
                             f"{high_var}); Mooncake's defaults are never assumed")  # fmt: skip
        return {}
    try:
        low, high = (int(p) for p in str(value).split("-"))
    except ValueError:
        raise ValueError(f"mooncake backend: port range {value!r} is not LOW-HIGH") from None
    if not 1024 <= low <= high < 32768:
        raise ValueError(f"mooncake backend: port range {value!r} must lie in 1024-32767 "
                         "(Mooncake refuses the ephemeral range)")  # fmt: skip
    return {low_var: str(low), high_var: str(high)}


def _master_listens(address: str, timeout_s: float = 0.5) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class MooncakeBackend(StorageBackend):
    name = "mooncake"

    def __init__(self, fmt: PageFormat, opts: dict, clock: Callable[[], float] = time.monotonic):
        super().__init__(fmt)
        if not opts.get("master_server_address"):
            raise ValueError('mooncake backend: extra-config needs "master_server_address"')
        self.opts = opts
        self.env = {**_range_env(opts["te_port_range"], "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"),
                    **_range_env(opts["client_port_range"], "MC_STORE_CLIENT_MIN_PORT",
                                 "MC_STORE_CLIENT_MAX_PORT")}  # fmt: skip
        self.gate = DownGate(float(opts["down_duration_s"]), clock)
        self.batch_pages = max(1, int(opts["batch_pages"]))
        self._store_cls = _store_class(self.env)
        self._lock = threading.Lock()
        self._store = None
        self._staging = bytearray(self.batch_pages * fmt.value_nbytes)
        self._staging_addr = ctypes.addressof(
            (ctypes.c_char * len(self._staging)).from_buffer(self._staging)
        )
        with self._lock:
            self._connect()

    @classmethod
    def from_config(cls, fmt: PageFormat, extra: dict) -> MooncakeBackend:
        return cls(fmt, take_options(extra, DEFAULTS, "mooncake"))

    @property
    def available(self) -> bool:
        return self.gate.up and self._store is not None

    # -- connection and gating -------------------------------------------------------------

    def _connect(self) -> bool:
        master = self.opts["master_server_address"]
        if not _master_listens(master):
            return self._down(f"master {master} does not answer", at_start=self._store is None)
        # read at setup(): a failed setup retries twice, not 20 times; RPCs give up in time
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        os.environ["MC_RPC_TIMEOUT_MS"] = str(int(self.opts["rpc_timeout_ms"]))
        store = self._store_cls()
        o = self.opts
        rc = store.setup(o["local_hostname"], o["metadata_server"], int(o["global_segment_size"]),
                         int(o["local_buffer_size"]), o["protocol"], o["device_name"], master)  # fmt: skip
        if rc != 0 or store.register_buffer(self._staging_addr, len(self._staging)) != 0:
            store.close()  # a half-set-up client keeps threads and ports otherwise
            return self._down(f"setup against {master} returned {rc}", at_start=True)
        self._store = store
        if self.gate.succeeded() or self.gate.outages == 0:
            log.info("storage backend mooncake: connected to master %s", master)
        return True

    def _down(self, error: str, at_start: bool = False) -> bool:
        if self.gate.failed(error):
            log.warning("storage backend mooncake is down (%s)%s; serving without it, retrying "
                        "every %.0f s", error, " at start-up" if at_start else "",
                        self.gate.down_duration_s)  # fmt: skip
        return False

    def _ready(self) -> bool:
        """May a call be made now? Reconnects (or re-probes) once the down duration is over."""
        if not self.gate.allow():
            return False
        if self._store is None:
            return self._connect()
        if not self.gate.up and not _master_listens(self.opts["master_server_address"]):
            return self._down("master does not answer")
        return True

    def _answered(self, codes: Sequence[int]) -> bool:
        if any(c in SERVICE_DOWN for c in codes):
            return self._down(f"Mooncake error {min(codes)}")
        if self.gate.succeeded():
            log.info("storage backend mooncake is back")
        return True

    # -- the interface ----------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        with self._lock:
            if not keys or not self._ready():
                return 0
            self.stats.exists_queries += 1
            codes = self._store.batch_is_exist(list(keys))
            if not self._answered([c for c in codes if c < 0]):
                return 0
        n = 0
        while n < len(codes) and codes[n] == 1:
            n += 1
        return n

    def get_pages(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> int:
        self._check_shapes(keys, buffers)
        with self._lock:
            done = 0
            while done < len(keys) and self._ready():
                chunk = list(keys[done : done + self.batch_pages])
                got = self._get_chunk(chunk, buffers[done : done + len(chunk)])
                done += got
                if got < len(chunk):
                    break
            return done

    def _get_chunk(self, keys: list[str], buffers: Sequence[Buffer]) -> int:
        size = self.fmt.value_nbytes
        ptrs = [self._staging_addr + i * size for i in range(len(keys))]
        codes = self._store.batch_get_into(keys, ptrs, [size] * len(keys))
        if not self._answered([c for c in codes if c < 0]):
            return 0
        staging = memoryview(self._staging)
        for i, (key, code, out) in enumerate(zip(keys, codes, buffers)):
            if code < 0:
                if code == BUFFER_TOO_SMALL:
                    self.stats.refused["size"] += 1
                else:
                    self.stats.misses += 1
                return i
            if not self._accept(key, staging[i * size : i * size + code], out):
                return i
        return len(keys)

    def put_pages(self, keys: Sequence[str], pages: Sequence[Buffer]) -> int:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        with self._lock:
            stored = 0
            for start in range(0, len(keys), self.batch_pages):
                if not self._ready():
                    break
                chunk = list(keys[start : start + self.batch_pages])
                stored += self._put_chunk(chunk, pages[start : start + len(chunk)])
            return stored

    def _put_chunk(self, keys: list[str], pages: Sequence[Buffer]) -> int:
        size = self.fmt.value_nbytes
        staging = memoryview(self._staging)
        for i, (key, page) in enumerate(zip(keys, pages)):
            self.fmt.frame_into(staging[i * size : (i + 1) * size], key, page)
        ptrs = [self._staging_addr + i * size for i in range(len(keys))]
        codes = self._store.batch_put_from(keys, ptrs, [size] * len(keys))
        if not self._answered([c for c in codes if c < 0]):
            return 0
        ok = sum(1 for c in codes if c == 0)
        self.stats.put_failures += len(keys) - ok
        # a key already there also answers 0 (kept, not rewritten): an upper bound of writes
        self.stats.pages_written += ok
        self.stats.bytes_written += ok * self.fmt.page_nbytes
        return ok

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


def _store_class(env: dict[str, str]):
    """Mooncake's client class, its port ranges set first: the transfer engine's range is read
    once, when the library loads, so a process that loaded it with other ranges cannot honour
    ours (refused rather than silently using other ports)."""
    if "mooncake.store" in sys.modules:
        clash = {k: v for k, v in env.items() if os.environ.get(k) != v}
        if clash:
            raise ValueError(f"mooncake backend: Mooncake was loaded in this process before its "
                             f"port ranges were set to {clash}; set them before it loads")  # fmt: skip
    os.environ.update(env)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise RuntimeError(
            "storage backend mooncake needs Mooncake Store: pip install 'radixserve[mooncake]' "
            f"and apt-get install libibverbs1 ({exc})"
        ) from None
    return MooncakeDistributedStore
