"""The storage tier's flags and counts: `--hicache-storage-*` checked into StorageSettings, the
prefetch policies' timeout, the model digest in the namespace, and what /metrics shows of it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.hashing import ALGORITHMS

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
OWN_KEYS = {"chunk_size": 256, "hash_algo": "sha256_cbor", "seed": 0, "write_queue_pages": 4096}


def weights_identity(model_dir: Any, head_bytes: int = 1 << 20) -> str:
    """A digest of a model directory's config and weight files (their names, sizes and first
    MiB): part of the storage namespace, so models that share a name never share pages."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    root = Path(model_dir)
    for path in sorted(root.iterdir()):
        if path.name == "config.json" or path.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            h.update(f"{path.name}:{path.stat().st_size}:".encode())
            with open(path, "rb") as f:
                h.update(f.read(head_bytes))
    return h.hexdigest()[:16]


def prefetch_timeout_s(tokens: int) -> float:
    """SGLang's timeout policy: 2 s + 0.1 s per 1,024 tokens, at most 30 s."""
    return min(2.0 + 0.1 * tokens / 1024, 30.0)


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """The flags checked: the backend, its extra config (without our own keys), the policy."""

    backend: str
    extra: dict[str, Any]
    prefetch_policy: str = "best_effort"
    chunk_size: int = 256
    hash_algo: str = "sha256_cbor"
    seed: int = 0
    write_queue_pages: int = 4096

    @classmethod
    def parse(cls, backend: str, extra_config: str | None, policy: str | None) -> StorageSettings:
        """From `--hicache-storage-backend`, `--hicache-storage-backend-extra-config` (JSON:
        the backend's keys plus ours: chunk_size, hash_algo, seed, write_queue_pages) and
        `--hicache-storage-prefetch-policy`; ValueError names what is wrong."""
        if backend not in ("mooncake", "file"):
            raise ValueError(f"--hicache-storage-backend must be mooncake or file, not {backend!r}")
        try:
            extra = json.loads(extra_config) if extra_config else {}
        except ValueError as e:
            raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
        own = {k: extra.pop(k, v) for k, v in OWN_KEYS.items()}
        for key in ("chunk_size", "write_queue_pages"):
            if type(own[key]) is not int or own[key] < 1:
                raise ValueError(f"--hicache-storage-backend-extra-config {key} must be an "
                                 f"integer >= 1, got {own[key]!r}")  # fmt: skip
        if own["hash_algo"] not in ALGORITHMS:
            raise ValueError(f"--hicache-storage-backend-extra-config hash_algo "
                             f"{own['hash_algo']!r}: choose from {sorted(ALGORITHMS)}")  # fmt: skip
        if type(own["seed"]) is not int:
            raise ValueError(f"--hicache-storage-backend-extra-config seed must be an integer, "
                             f"got {own['seed']!r}")  # fmt: skip
        policy = policy or "best_effort"
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"--hicache-storage-prefetch-policy must be one of "
                             f"{', '.join(PREFETCH_POLICIES)}, not {policy!r}")  # fmt: skip
        return cls(backend, extra, policy, **own)


@dataclass(slots=True)
class StorageCounts:
    """What /metrics shows of the storage tier (monotonic counts, and whether it is up)."""

    storage_up: int = 1
    storage_prefetch_lookups: int = 0
    storage_prefetch_waits: int = 0  # requests held while their prefetch ran
    storage_prefetch_timeouts: int = 0  # held requests queued at their deadline
    storage_prefetch_failures: int = 0  # prefetches that loaded fewer pages than listed
    storage_prefetch_tokens: int = 0  # tokens landed in the host tier from the store
    storage_prefetch_skipped_pages: int = 0  # not read: beyond the host room for a prefetch
    storage_prefetch_unlanded_pages: int = 0  # read, but the host room was gone when they came
    storage_write_dropped_pages: int = 0  # not written: the writer's queue was full
    storage_pages_written: int = 0
    storage_pages_gathered: int = 0  # pages read from the device pool for the writer
    storage_write_pinned_tokens: int = 0  # device tokens pinned for the writer now
    storage_bytes_written: int = 0
    storage_pages_read: int = 0
    storage_bytes_read: int = 0
    storage_refused_pages: int = 0  # values of another namespace, size, key or checksum
    storage_cached_tokens: int = 0  # prompt tokens served from pages the store gave
    extra: dict[str, int] = field(default_factory=dict)
