"""The storage tier's contract without Mooncake: the value header refuses another namespace's,
size's or key's bytes; the file backend is write-once, atomic and prefix-shaped; the down gate."""

from __future__ import annotations

import multiprocessing
import shutil

import pytest

from radixserve.cache.hashing import block_hashes
from radixserve.kvstore.backends import create_backend
from radixserve.kvstore.gate import DownGate
from radixserve.kvstore.storage import HEADER, PageFormat

NS = "rkv1-smollm2-135m-bf16-p16"  # a KVNamespace digest stand-in: any non-empty string
FMT = PageFormat(NS, 4096)


def pages(n: int, size: int = 4096) -> list[bytes]:
    return [bytes([i + 1]) * size for i in range(n)]


def keys(n: int) -> list[str]:
    return block_hashes(list(range(16 * n)), 16, "sha256", namespace=NS)


def test_header_refuses_every_mismatch():
    key = keys(1)[0]
    value = FMT.frame(key, pages(1)[0])
    assert len(value) == HEADER.size + 4096 and FMT.refusal(key, value) is None
    assert PageFormat(NS + "x", 4096).refusal(key, value) == "namespace"
    assert PageFormat(NS, 2048).refusal(key, value) == "size"
    assert FMT.refusal("another-key", value) == "key"
    assert FMT.refusal(key, value[:-1]) == "size"
    assert FMT.refusal(key, value[:10]) == "size"
    corrupt = bytearray(value)
    corrupt[-1] ^= 0xFF
    assert FMT.refusal(key, corrupt) == "checksum"
    assert FMT.refusal(key, b"XXXX" + value[4:]) == "format"
    with pytest.raises(ValueError, match="page of 100 bytes"):
        FMT.frame(key, b"x" * 100)


@pytest.fixture
def file_backend(tmp_path):
    backend = create_backend("file", FMT, {"path": str(tmp_path)})
    yield backend
    backend.close()


def test_file_roundtrip_write_once_and_present_prefix(file_backend, tmp_path):
    ks, ps = keys(4), pages(4)
    assert file_backend.put_pages([ks[0], ks[1], ks[3]], [ps[0], ps[1], ps[3]]) == 3
    assert file_backend.put_pages([ks[0]], [b"\xee" * 4096]) == 1  # already there: kept as is
    assert file_backend.exists_prefix(ks) == 2
    out = [bytearray(4096) for _ in ks]
    assert file_backend.get_pages(ks, out) == 2  # key 2 missing mid-batch: only 0 and 1 used
    assert out[0] == ps[0] and out[1] == ps[1] and out[3] == bytearray(4096)
    assert not list(tmp_path.rglob(".tmp-*"))
    assert file_backend.stats.pages_written == 3 and file_backend.stats.misses == 1


def test_file_refuses_wrong_size_and_namespace(file_backend, tmp_path):
    ks = keys(2)
    other_size = create_backend("file", PageFormat(NS, 2048), {"path": str(tmp_path)})
    assert other_size.put_pages(ks[:1], [b"a" * 2048]) == 1  # same namespace dir, other size
    out = [bytearray(4096)]
    assert file_backend.get_pages(ks[:1], out) == 0 and out[0] == bytearray(4096)
    assert file_backend.stats.refused["size"] == 1
    # a foreign engine's file copied under this namespace's name: refused by its header
    foreign = create_backend("file", PageFormat("model=other", 4096), {"path": str(tmp_path)})
    foreign.put_pages(ks[1:], pages(1))
    src = foreign._path(ks[1])
    dst = file_backend._path(ks[1])
    dst.parent.mkdir(exist_ok=True)
    shutil.copy(src, dst)
    assert file_backend.get_pages(ks[1:], out) == 0 and out[0] == bytearray(4096)
    assert file_backend.stats.refused["namespace"] == 1


def _writer(root: str, key: str, byte: int, barrier) -> None:
    backend = create_backend("file", FMT, {"path": root})
    barrier.wait()
    backend.put_pages([key], [bytes([byte]) * 4096])


def test_file_concurrent_writers_leave_one_whole_value(tmp_path):
    key, ctx = keys(1)[0], multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [
        ctx.Process(target=_writer, args=(str(tmp_path), key, b, barrier)) for b in (1, 2, 3, 4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    out = [bytearray(4096)]
    backend = create_backend("file", FMT, {"path": str(tmp_path)})
    assert backend.get_pages([key], out) == 1
    assert len(set(out[0])) == 1 and out[0][0] in (1, 2, 3, 4)  # one writer's page, whole
    assert not list(tmp_path.rglob(".tmp-*"))


def test_file_leftover_temporaries_are_removed_at_start(tmp_path):
    backend = create_backend("file", FMT, {"path": str(tmp_path)})
    backend.put_pages(keys(1), pages(1))
    stale = backend._path(keys(1)[0]).parent / ".tmp-crashed"
    stale.write_bytes(b"half")
    create_backend("file", FMT, {"path": str(tmp_path)})
    assert not stale.exists()


def test_create_backend_refuses_bad_config(tmp_path):
    with pytest.raises(ValueError, match="unknown storage backend 'nfs'"):
        create_backend("nfs", FMT, {})
    with pytest.raises(ValueError, match=r"unknown extra-config key\(s\) \['pth'\]"):
        create_backend("file", FMT, {"pth": str(tmp_path)})
    with pytest.raises(ValueError, match='needs "path"'):
        create_backend("file", FMT, {})
    with pytest.raises(ValueError, match="buffer of 10 bytes"):
        create_backend("file", FMT, {"path": str(tmp_path)}).get_pages(["k"], [bytearray(10)])


def test_mooncake_backend_refuses_ports_it_would_have_to_guess(monkeypatch):
    for var in ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="Mooncake's defaults are never assumed"):
        create_backend("mooncake", FMT, {"master_server_address": "127.0.0.1:1"})
    with pytest.raises(ValueError, match="ephemeral range"):
        create_backend("mooncake", FMT, {"master_server_address": "127.0.0.1:1",
                                         "te_port_range": "40000-40100"})  # fmt: skip
    with pytest.raises(ValueError, match='needs "master_server_address"'):
        create_backend("mooncake", FMT, {})


def test_down_gate_refuses_for_the_duration_then_retries():
    now = [100.0]
    gate = DownGate(30.0, clock=lambda: now[0])
    assert gate.allow() and gate.failed("boom") is True  # the first failure takes it down
    assert not gate.allow() and gate.refused == 1
    now[0] += 29.9
    assert not gate.allow()
    now[0] += 0.2
    assert gate.allow()  # the duration is over: one try
    assert gate.failed("again") is False and not gate.allow()  # still down: no second log line
    now[0] += 30
    assert gate.allow() and gate.succeeded() is True and gate.up and gate.outages == 1
