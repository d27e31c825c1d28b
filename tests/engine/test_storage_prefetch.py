"""The storage tier's prefetch into a host tier that write-through has filled with copies of
the device pool (``--hicache-ratio`` near 1): pages from a real `file` store land, the copies of
device pages giving way, and the bytes in the host tier are the ones the writing engine
computed; a prefetch is sized to the room there is (what cannot land is not read, counted), the
prefetches in flight included. Real parts: torch KV pools, the host pool, the scheduler's
KVManager and radix tree, the storage tier's threads."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from radixserve.cache.hashing import KVNamespace  # noqa: E402
from radixserve.config import CacheConfig  # noqa: E402
from radixserve.engine.storage_settings import StorageSettings  # noqa: E402
from radixserve.engine.storage_tier import StorageTier  # noqa: E402
from radixserve.model.host_pool import HostKVPool  # noqa: E402
from radixserve.model.kv_pool import KVPool  # noqa: E402
from radixserve.sched.kv import KVManager  # noqa: E402

CHUNK = 16
DEVICE = 256
FILLERS = [list(range(b, b + 3 * CHUNK)) for b in range(20000, 25000, 1000)]  # 5 x 48 tokens


class Engine:
    """One engine's scheduler side: a device pool with random KV, its host tier, the tree and
    the storage tier on a shared `file` store (``wait_complete`` prefetches)."""

    def __init__(self, store: Path, device: int, host: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.pool = KVPool(2, device, 2, 8, torch.float32, "cpu")
        self.pool.kv.copy_(torch.randn(self.pool.kv.shape, generator=gen))
        self.host = HostKVPool(self.pool, host)
        self.kv = KVManager(CacheConfig(max_total_tokens=device), host_tokens=host)
        settings = StorageSettings("file", {"path": str(store)}, "wait_complete", CHUNK)
        self.tier = StorageTier(settings, KVNamespace("tiny@test", "float32", 2, 2, 8, CHUNK),
                                self.host)  # fmt: skip

    def compute(self, ids: list[int]) -> list[int]:
        """A finished request's prompt in the tree (write-through: its host copy made, as the
        next forward's copies do)."""
        assert self.kv.ensure_free(len(ids))
        slots = list(self.kv.allocator.alloc(len(ids)))
        self.kv.cache.insert(ids, slots)
        self.host.apply(self.kv.take_copies())
        return slots

    def page(self, kv: torch.Tensor, slots: list[int], i: int) -> bytes:
        ids = torch.tensor(slots[i * CHUNK : (i + 1) * CHUNK])
        return kv.index_select(2, ids).contiguous().numpy().tobytes()

    def host_slots(self, ids: list[int]) -> list[int]:
        """The host slots of ``ids``' host-only prefix (nothing of it on the device)."""
        root = self.kv.cache.namespace_root(None)
        chain = self.kv.cache.match_host(ids, root, 0, len(ids))
        return [s for node in chain for s in node.host]

    def prefetch(self, *prompts: list[int]) -> None:
        """Look each prompt up (each waits on its prefetch), then poll until all are back."""
        reqs = [SimpleNamespace(rid=f"r{i}", input_ids=p, namespace=None)
                for i, p in enumerate(prompts)]  # fmt: skip
        assert all(self.tier.lookup(r, self.kv.cache) for r in reqs)
        back: list = []
        deadline = time.monotonic() + 30
        while len(back) < len(reqs):
            assert time.monotonic() < deadline, self.tier.stats()
            back += self.tier.poll(self.kv.cache)
            time.sleep(0.01)


@pytest.fixture
def engines(tmp_path):
    made: list[Engine] = []

    def make(device: int, host: int, seed: int) -> Engine:
        made.append(Engine(tmp_path / "kv", device, host, seed))
        return made[-1]

    yield make
    for e in made:
        e.tier.close(e.kv)


def written(e: Engine, ids: list[int]) -> list[int]:
    """``e`` computes ``ids`` and writes its whole chunks to the store; returns its slots."""
    slots = e.compute(ids)
    e.tier.offer_write(ids, None, e.kv)
    deadline = time.monotonic() + 30
    while e.tier.stats()["storage_pages_written"] < len(ids) // CHUNK:
        assert time.monotonic() < deadline, e.tier.stats()
        time.sleep(0.01)
    assert e.tier.release_pins(e.kv, wait_s=5) == 0
    return slots


def full_reader(engines) -> Engine:
    """An engine whose device pool holds five prompts (240 tokens), all copied to its host
    tier of 272 slots: 32 free, no host-only page to evict."""
    b = engines(DEVICE, DEVICE + CHUNK, seed=1)
    for ids in FILLERS:
        b.compute(ids)
    assert b.kv.cache.host_size() == 240 and b.kv.cache.host_only_size() == 0
    return b


def test_a_prefetch_beyond_the_free_host_slots_lands(engines) -> None:
    """Six pages (96 tokens) with 32 host slots free: before, they were read and dropped;
    now they land on the room the device pages' host copies make, byte for byte as the
    writing engine computed them, and the device keeps every prompt it had."""
    a = engines(DEVICE, DEVICE, seed=0)
    prompt = list(range(1000, 1000 + 6 * CHUNK + 5))
    slots = written(a, prompt)
    b = full_reader(engines)
    b.prefetch(prompt)
    stats = b.tier.stats()
    assert stats["storage_prefetch_tokens"] == 6 * CHUNK and stats["storage_pages_read"] == 6
    assert stats["storage_prefetch_skipped_pages"] == stats["storage_prefetch_unlanded_pages"] == 0
    landed = b.host_slots(prompt)
    assert len(landed) == 6 * CHUNK
    assert all(b.page(b.host.kv, landed, i) == a.page(a.pool.kv, slots, i) for i in range(6))
    assert all(b.kv.cache.match_prefix(ids).length == len(ids) for ids in FILLERS)
    b.kv.check([], in_flight=False)


def test_a_prefetch_reads_only_what_the_host_room_holds(engines) -> None:
    """The host tier has room for 17 pages (272 slots); a 6-page prefetch is in flight when a
    20-page one is looked up: the second reads 11 pages, the other 9 are skipped (never read),
    and all 17 land."""
    a = engines(2 * DEVICE, 2 * DEVICE, seed=0)
    short = list(range(1000, 1000 + 6 * CHUNK + 1))
    long = list(range(3000, 3000 + 20 * CHUNK + 1))
    written(a, short)
    written(a, long)
    b = full_reader(engines)
    b.prefetch(short, long)
    stats = b.tier.stats()
    assert stats["storage_pages_read"] == 17 and stats["storage_prefetch_skipped_pages"] == 9
    assert stats["storage_prefetch_tokens"] == 17 * CHUNK
    assert len(b.host_slots(short)) == 6 * CHUNK and len(b.host_slots(long)) == 11 * CHUNK
    assert b.kv.cache.host_size() == DEVICE + CHUNK  # all of it: the copies gave way
    b.kv.check([], in_flight=False)
