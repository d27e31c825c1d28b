"""The storage backends by name (`--hicache-storage-backend`): a module of its own, above
storage.py and the backends, so that the backends' modules import storage.py one way."""

from __future__ import annotations

from radixserve.kvstore import storage_file, storage_mooncake
from radixserve.kvstore.storage import PageFormat, StorageBackend


def create_backend(name: str, fmt: PageFormat, extra_config: dict | None = None) -> StorageBackend:
    """The backend called ``name`` (`--hicache-storage-backend`), configured from the JSON of
    `--hicache-storage-backend-extra-config`; an unknown name or key is a ValueError."""
    backends = {"file": storage_file.FileBackend, "mooncake": storage_mooncake.MooncakeBackend}
    if name not in backends:
        raise ValueError(f"unknown storage backend {name!r}; choose from {sorted(backends)}")
    return backends[name].from_config(fmt, dict(extra_config or {}))
