"""HostKVPool: the host tier's KV bytes, and the batched page copies between it and the device
pool that the scheduler's ``Batch.kv_copies`` list (applied before the batch's forward)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.model.kv_pool import KVPool


class HostKVPool:
    """One tensor shaped like the device pool's, ``[layers, 2, host_slots, heads, dim]``, in
    host memory; pinned when the device pool is on a GPU, so copies run at full PCIe speed."""

    def __init__(self, device_pool: KVPool, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        src = device_pool.kv
        shape = (src.shape[0], src.shape[1], num_slots, *src.shape[3:])
        pin = src.device.type == "cuda"
        self.device_pool = device_pool
        self.kv = torch.zeros(shape, dtype=src.dtype, device="cpu", pin_memory=pin)
        self.bytes_stored = self.bytes_loaded = 0
        self._streams: dict[int, Any] = {}  # per reading thread, on a GPU (read_device_pages)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def bytes_per_slot(self) -> int:
        return self.nbytes // self.kv.shape[2]

    def apply(self, copies: Sequence[Any]) -> tuple[float, int]:
        """Run ``copies`` (``cache.tiers.PageCopy``) in order; a run of copies of one kind is
        one gather and one scatter over all layers. Returns the seconds the loads (host ->
        device) took and the slots they wrote, for the engine's load-to-prefill ratio."""
        i, seconds, loaded = 0, 0.0, 0
        while i < len(copies):
            j = i
            while j < len(copies) and copies[j].kind == copies[i].kind:
                j += 1
            if copies[i].kind == "store":
                self._store(copies[i:j])
            else:
                t0 = time.perf_counter()
                loaded += self._load(copies[i:j])
                seconds += time.perf_counter() - t0
            i = j
        return seconds, loaded

    def _store(self, run: Sequence[Any]) -> None:
        src, dst = _pairs(run, True)
        data = self.device_pool.read_slots(_ids(src, self.device_pool.kv.device))
        self.kv.index_copy_(2, _ids(dst, "cpu"), data.to("cpu"))
        self.bytes_stored += len(dst) * self.bytes_per_slot

    def _load(self, run: Sequence[Any]) -> int:
        """The loads of ``run``; on a GPU waits for the scatter, so that its time is the
        load's (the forward after it waits for it anyway)."""
        src, dst = _pairs(run, False)
        data = self.kv.index_select(2, _ids(src, "cpu"))
        device = self.device_pool.kv.device
        self.device_pool.write_slots(_ids(dst, device), data)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.bytes_loaded += len(dst) * self.bytes_per_slot
        return len(dst)

    # -- pages of the storage tier (engine.storage_tier) -------------------------------------
    def device_ready(self) -> Any:
        """Called by the scheduler thread after a forward: what a reader on another thread
        waits for before reading the KV that forward wrote (a CUDA event on the current stream;
        None on the CPU, where the forward has returned with its writes done)."""
        if self.device_pool.kv.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def read_device_pages(
        self, slots: Sequence[int], chunk: int, ready: Any = None
    ) -> list[memoryview]:
        """The device pool's KV at ``slots`` (a whole number of ``chunk``-token pages) as one
        byte view per page, each laid out ``[layers, 2, chunk, heads, dim]`` (the namespace's
        layout), from one gather. Safe on a thread other than the scheduler's while those slots
        are kept (pinned): on a GPU it runs on a stream of its own after ``ready``
        (``device_ready``'s event), so the forwards that follow are not held up by it."""
        pool = self.device_pool
        device = pool.kv.device
        if device.type != "cuda":
            return self._pages(pool.read_slots(_ids(list(slots), device)), chunk)
        stream = self._streams.get(threading.get_ident())
        if stream is None:
            stream = self._streams[threading.get_ident()] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            else:
                stream.wait_stream(torch.cuda.default_stream(device))
            data = pool.read_slots(_ids(list(slots), device)).to("cpu")  # synchronizes
        return self._pages(data, chunk)

    @staticmethod
    def _pages(data: torch.Tensor, chunk: int) -> list[memoryview]:
        """``data`` (on the CPU) cut into one byte view per ``chunk``-token page."""
        layers, two, n, *tail = data.shape
        k = n // chunk
        pages = data.view(layers, two, k, chunk, *tail).movedim(2, 0).contiguous()
        raw = pages.view(torch.uint8).view(k, -1).numpy()
        return [memoryview(raw[i]) for i in range(k)]

    def write_host_pages(self, slots: Sequence[int], pages: Any, chunk: int) -> None:
        """Store ``pages`` (a buffer of ``len(slots) // chunk`` pages, each as
        ``read_device_pages`` gives it) at host ``slots``."""
        k = len(slots) // chunk
        layers, two, _, *tail = self.kv.shape
        raw = torch.frombuffer(pages, dtype=torch.uint8, count=k * chunk * self.bytes_per_slot)
        data = raw.view(self.kv.dtype).view(k, layers, two, chunk, *tail).movedim(0, 2)
        self.kv.index_copy_(
            2, _ids(list(slots), "cpu"), data.reshape(layers, two, k * chunk, *tail)
        )


def _pairs(run: Sequence[Any], store: bool) -> tuple[list[int], list[int]]:
    """Source and destination slots of a run; a destination written twice keeps its last
    source (a slot freed and reused within one step), as one scatter cannot order them."""
    last: dict[int, int] = {}
    for c in run:
        src, dst = (c.device, c.host) if store else (c.host, c.device)
        last.update(zip(dst, src))
    return list(last.values()), list(last)


def _ids(slots: list[int], device: Any) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64, device=device)
