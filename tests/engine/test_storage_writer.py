"""The storage tier's write path (issue 27 item 2: "a page is written once, off the scheduler's
critical path"), on the real parts of an engine: a torch KV pool with distinct values in every
slot, the host pool, the scheduler's KVManager and radix tree, and a real `file` store. The thread
that offers a prompt (the scheduler's) never reads the pool: the writer thread does, after asking
the store, and reads only the pages the store lacks; the pages it reads are pinned in the tree
until it has read them, so eviction and reuse of the pool meanwhile never change what is stored;
a full queue pins nothing; close releases every pin."""

from __future__ import annotations

import threading
import time
from pathlib import Path

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
TOTAL = 256  # device slots
PROMPT = list(range(1000, 1000 + 6 * CHUNK + 5))  # six whole chunks and a tail


class Side:
    """One engine's scheduler-side state: pool (random KV per slot), tree, storage tier; the
    pool's page reads recorded with the thread that made them."""

    def __init__(self, store: Path, queue_pages: int = 4096, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.pool = KVPool(2, TOTAL, 2, 8, torch.float32, "cpu")
        self.pool.kv.copy_(torch.randn(self.pool.kv.shape, generator=gen))
        self.host = HostKVPool(self.pool, TOTAL)
        self.kv = KVManager(CacheConfig(max_total_tokens=TOTAL), host_tokens=TOTAL)
        settings = StorageSettings("file", {"path": str(store)}, chunk_size=CHUNK,
                                   write_queue_pages=queue_pages)  # fmt: skip
        ns = KVNamespace("tiny@test", "float32", 2, 2, 8, CHUNK)
        self.tier = StorageTier(settings, ns, self.host)
        self.reads: list[tuple[str, int]] = []  # (thread name, slots read)
        read = self.host.read_device_pages

        def recorded(slots, chunk, ready=None):
            self.reads.append((threading.current_thread().name, len(slots)))
            return read(slots, chunk, ready)

        self.host.read_device_pages = recorded  # type: ignore[method-assign]

    def compute(self, ids: list[int]) -> list[int]:
        """What a finished request leaves: its prompt's KV in the tree at fresh slots."""
        assert self.kv.ensure_free(len(ids))
        slots = list(self.kv.allocator.alloc(len(ids)))
        self.kv.cache.insert(ids, slots)
        return slots

    def page(self, slots: list[int], i: int) -> bytes:
        """Page ``i`` of a prompt at ``slots``, as the store keeps it."""
        ids = torch.tensor(slots[i * CHUNK : (i + 1) * CHUNK])
        return self.pool.kv.index_select(2, ids).contiguous().numpy().tobytes()

    def stored(self, ids: list[int], i: int) -> bytes:
        key = self.tier.keys(ids, None)[i]
        buf = bytearray(self.tier.page_nbytes)
        assert self.tier.backend.get_pages([key], [memoryview(buf)]) == 1, f"page {i} not stored"
        return bytes(buf)

    def wait_written(self, pages: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tier.stats()["storage_pages_written"] < pages:
            assert time.monotonic() < deadline, self.tier.stats()
            time.sleep(0.01)


@pytest.fixture
def sides():
    made: list[Side] = []
    yield made
    for s in made:
        s.tier.close(s.kv)


def blocked(side: Side) -> threading.Event:
    """Hold the writer in its first store call until the event is set (the store hung)."""
    go = threading.Event()
    exists = side.tier.backend.exists_prefix

    def held(keys):
        assert go.wait(30)
        return exists(keys)

    side.tier.backend.exists_prefix = held  # type: ignore[method-assign]
    return go


def test_the_scheduler_thread_never_reads_the_pool(tmp_path, sides) -> None:
    """The offer returns having read nothing; the writer thread reads the six pages and the
    store holds exactly the pool's bytes; pins are released between steps."""
    a = Side(tmp_path / "kv")
    sides.append(a)
    go = blocked(a)
    slots = a.compute(PROMPT)
    a.tier.offer_write(PROMPT, None, a.kv)
    assert a.reads == []  # returned without reading the pool
    # the node holding them is pinned (it goes on to the prompt's end)
    assert a.tier.stats()["storage_write_pinned_tokens"] == a.kv.cache.protected_size()
    assert a.kv.cache.protected_size() == len(PROMPT)
    go.set()
    a.wait_written(6)
    assert a.reads == [("kv-storage-write", 6 * CHUNK)]
    assert all(a.stored(PROMPT, i) == a.page(slots, i) for i in range(6))
    assert a.tier.release_pins(a.kv, wait_s=5) == 0
    assert not a.kv.pins and a.kv.cache.protected_size() == 0
    assert a.tier.stats()["storage_write_pinned_tokens"] == 0
    a.kv.check([], in_flight=False)  # every lock and count accounted for


def test_pages_the_store_holds_are_never_read(tmp_path, sides) -> None:
    """Another engine (its own pool, other slots) offers a prompt sharing four chunks with what
    the first one stored: its writer reads only the three it lacks."""
    a, b = Side(tmp_path / "kv"), Side(tmp_path / "kv", seed=1)
    sides += [a, b]
    a.compute(PROMPT)
    a.tier.offer_write(PROMPT, None, a.kv)
    a.wait_written(6)
    other = PROMPT[: 4 * CHUNK] + list(range(5000, 5000 + 3 * CHUNK))
    b.compute([7] * 40)  # b's slots differ from a's
    slots = b.compute(other)
    b.tier.offer_write(other, None, b.kv)
    b.wait_written(3)
    assert b.reads == [("kv-storage-write", 3 * CHUNK)]
    assert b.tier.stats()["storage_pages_gathered"] == 3
    assert all(b.stored(other, i) == b.page(slots, i) for i in range(4, 7))
    assert b.tier.release_pins(b.kv, wait_s=5) == 0


def test_pinned_pages_outlive_eviction_until_read(tmp_path, sides) -> None:
    """With the writer held, the scheduler evicts everything it can and reuses every free slot
    (new KV written there): the pinned pages are not among them, and the store gets the bytes
    the prompt computed. A second offer past the queue's bound is dropped, counted, pinning
    nothing; once read, the pin is released and the pages are evictable again."""
    a = Side(tmp_path / "kv", queue_pages=8)
    sides.append(a)
    go = blocked(a)
    slots = a.compute(PROMPT)
    want = [a.page(slots, i) for i in range(6)]
    a.tier.offer_write(PROMPT, None, a.kv)
    second = list(range(9000, 9000 + 4 * CHUNK))
    a.compute(second)
    a.tier.offer_write(second, None, a.kv)  # 6 + 4 pages > 8: dropped
    assert a.tier.stats()["storage_write_dropped_pages"] == 4
    assert list(a.kv.pins.values()) == [1]
    # the pool fills: everything evictable goes, every free slot gets new KV
    assert not a.kv.ensure_free(TOTAL)
    assert a.kv.cache.protected_size() == len(PROMPT)
    fresh = list(a.kv.allocator.alloc(a.kv.allocator.available()))
    assert not set(fresh) & set(slots[: 6 * CHUNK])
    a.pool.kv[:, :, fresh] = 0.0
    go.set()
    a.wait_written(6)
    assert [a.stored(PROMPT, i) for i in range(6)] == want
    assert a.tier.release_pins(a.kv, wait_s=5) == 0
    a.kv.allocator.free(fresh)
    assert a.kv.ensure_free(TOTAL)  # unpinned: evictable again


def test_close_releases_every_pin(tmp_path) -> None:
    a = Side(tmp_path / "kv")
    go = blocked(a)
    a.compute(PROMPT)
    a.tier.offer_write(PROMPT, None, a.kv)
    assert a.kv.pins
    threading.Timer(0.2, go.set).start()
    a.tier.close(a.kv)
    assert not a.kv.pins and a.kv.cache.protected_size() == 0


def test_one_prompt_is_always_taken_however_long(tmp_path, sides) -> None:
    """The pins out are bounded by half the pool, but a prompt longer than that is still
    written when nothing else is pinned (it fit in the pool to be computed)."""
    a = Side(tmp_path / "kv")
    sides.append(a)
    long = list(range(3000, 3000 + 10 * CHUNK + 5))  # 165 tokens of a 256-slot pool
    slots = a.compute(long)
    a.tier.offer_write(long, None, a.kv)
    a.wait_written(10)
    assert a.tier.stats()["storage_write_dropped_pages"] == 0
    assert all(a.stored(long, i) == a.page(slots, i) for i in range(10))
    assert a.tier.release_pins(a.kv, wait_s=5) == 0
