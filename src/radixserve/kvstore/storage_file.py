"""The `file` storage backend: one file per page under a directory (one machine, or a shared
filesystem), written atomically and never overwritten."""

# Atomic, write-once: a page is written to a temporary file in its final directory, flushed, then
# hard-linked to its name; link() fails when the name exists, so a value is never replaced and a
# reader never sees a half-written one (a crash leaves only a temporary file, removed at start).
# Pages of different namespaces live in different directories; the header is still checked on
# every read, as for every backend. Keys that are not plain file names are stored by their hash.

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from radixserve.kvstore.storage import Buffer, PageFormat, StorageBackend, take_options

_PLAIN = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_TMP_PREFIX = ".tmp-"


class FileBackend(StorageBackend):
    name = "file"

    def __init__(self, fmt: PageFormat, root: str | os.PathLike, fsync: bool = False) -> None:
        super().__init__(fmt)
        self.dir = Path(root) / fmt.ns_digest.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        for stale in self.dir.glob(f"*/{_TMP_PREFIX}*"):
            stale.unlink(missing_ok=True)

    @classmethod
    def from_config(cls, fmt: PageFormat, extra: dict) -> FileBackend:
        opts = take_options(extra, {"path": None, "fsync": False}, "file")
        if not opts["path"]:
            raise ValueError('file backend: extra-config needs "path" (a directory)')
        return cls(fmt, opts["path"], bool(opts["fsync"]))

    def _path(self, key: str) -> Path:
        name = key if _PLAIN.fullmatch(key) and not key.startswith(".") else None
        name = name or hashlib.sha256(key.encode()).hexdigest()
        return self.dir / name[-2:] / name

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self.stats.exists_queries += 1
        for i, key in enumerate(keys):
            if not self._path(key).is_file():
                return i
        return len(keys)

    def get_pages(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> int:
        self._check_shapes(keys, buffers)
        value = bytearray(self.fmt.value_nbytes + 1)  # one spare byte shows a too-long value
        view = memoryview(value)
        for i, (key, out) in enumerate(zip(keys, buffers)):
            try:
                with open(self._path(key), "rb", buffering=0) as f:
                    n = f.readinto(view)
            except OSError:
                self.stats.misses += 1
                return i
            if not self._accept(key, view[:n], out):
                return i
        return len(keys)

    def put_pages(self, keys: Sequence[str], pages: Sequence[Buffer]) -> int:
        value = bytearray(self.fmt.value_nbytes)
        stored = 0
        for key, page in zip(keys, pages, strict=True):
            path = self._path(key)
            if path.exists():
                stored += 1
                continue
            self.fmt.frame_into(memoryview(value), key, page)
            if self._write_once(path, value):
                stored += 1
        return stored

    def _write_once(self, path: Path, value: bytearray) -> bool:
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.link(tmp, path)
        except FileExistsError:
            return True  # another writer got there first: same key, same page
        except OSError:
            self.stats.put_failures += 1
            return False
        finally:
            os.unlink(tmp)
        self.stats.pages_written += 1
        self.stats.bytes_written += self.fmt.page_nbytes
        return True
