"""``--tp-size N``: the model split over N processes. Rank 0 is the runner inside the scheduler
process (it samples); ranks 1..N-1 are child processes (``engine/tp_worker.py``) that compute
their shard of every step.

Each step's Batch (plain lists, the scheduler's slot ids included, so every rank's KV pool holds
its own heads at the same slots) goes to every rank over a ZeroMQ PUSH socket before rank 0
computes it; the layers' all-reduces run over ``torch.distributed`` (gloo on a CPU, NCCL on
CUDA) with a timeout. Idle ranks wait on their socket, not in a collective, so an idle engine
never trips the timeout. A watchdog thread polls the rank processes: one that exits takes the
scheduler process down at once with a message naming it, so the server fails requests (503)
instead of waiting on a collective that cannot finish.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import zmq

from radixserve.config import ModelConfig
from radixserve.sched.batch import Batch, StepResult

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # an all-reduce (or the start-up rendezvous) waits this long at most
WATCH_INTERVAL_S = 0.2


@dataclasses.dataclass(frozen=True, slots=True)
class RankArgs:
    """What a rank process is started with (pickled onto its stdin)."""

    model: ModelConfig
    num_slots: int
    rank: int
    size: int
    base: str  # the prefix of the ZeroMQ endpoints (abstract sockets: no file to remove)
    store_port: int  # rank 0's TCPStore, where the ranks meet (on 127.0.0.1)
    parent_pid: int


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the next GPU after the one named (``cuda`` is ``cuda:0``) for
    each rank; a CPU for all of them."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


def gpu_shortage(device: str, size: int) -> str | None:
    """Why ``size`` ranks from ``device`` do not each find a GPU of their own (NCCL runs one
    rank per GPU: two on one device are refused by it), or None; a CPU holds any number."""
    if not device.startswith("cuda") or size == 1:
        return None
    import torch

    first, have = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    if first + size <= have:
        return None
    return (f"--tp-size {size} on {device}: the ranks need cuda:{first}..cuda:{first + size - 1}, "
            f"one GPU each (NCCL runs one rank per GPU), and this machine has {have}")  # fmt: skip


def open_store(port: int = 0) -> Any:
    """Rank 0's rendezvous store (``port`` 0: a free one) or a rank's client of it."""
    import torch.distributed as dist

    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    return dist.TCPStore("127.0.0.1", port, is_master=port == 0, wait_for_workers=False,
                         timeout=timeout)  # fmt: skip


def init_group(args: RankArgs, store: Any) -> None:
    """Join the ranks' process group: gloo on a CPU, NCCL on CUDA, collectives time out."""
    import torch
    import torch.distributed as dist

    device = rank_device(args.model.device, args.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=store,
        rank=args.rank,
        world_size=args.size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def rank_config(args: RankArgs) -> ModelConfig:
    return dataclasses.replace(args.model, device=rank_device(args.model.device, args.rank))


class TPRunner:
    """Rank 0 of ``model.tp_size`` ranks, behind the same interface as a TorchRunner (what it
    does not define is rank 0's TorchRunner's)."""

    def __init__(self, model_config: ModelConfig, num_slots: int) -> None:
        from radixserve.model.runner import TorchRunner, read_arch
        from radixserve.model.tp import TPShard, tp_problem
        from radixserve.modelfiles.locate import resolve_model_dir

        size = model_config.tp_size
        arch = read_arch(resolve_model_dir(model_config))
        if problem := tp_problem(arch, size) or gpu_shortage(model_config.device, size):
            raise ValueError(problem)  # before any process starts
        self.base = f"@radixserve-tp-{uuid.uuid4().hex[:12]}"
        self.death_note: str | None = None  # where the watchdog says why (engine/launch.py)
        self.closing = threading.Event()  # close() stops the ranks: the watchdog stands down
        store = open_store()
        args = RankArgs(model_config, num_slots, 0, size, self.base, store.port, os.getpid())
        ctx = zmq.Context.instance()
        ready = ctx.socket(zmq.PULL)
        ready.bind(f"ipc://{self.base}-ready")
        self.procs = [_spawn(dataclasses.replace(args, rank=r)) for r in range(1, size)]
        try:
            init_group(args, store)
            self.local = TorchRunner(rank_config(args), num_slots, TPShard(0, size))
            self._await_ranks(ready)
        except BaseException:
            self.close()
            raise
        finally:
            ready.close(linger=0)
        self.socks = [_push(ctx, f"ipc://{self.base}-tp{r}") for r in range(1, size)]
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        if name == "local":  # not built (yet): no recursion
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def rank_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _await_ranks(self, ready: zmq.Socket) -> None:
        """Every rank's ``ready`` (its shard loaded); a rank's error (one line) or exit fails
        the start."""
        waiting = len(self.procs)
        while waiting:
            if ready.poll(int(WATCH_INTERVAL_S * 1000)):
                status, detail = ready.recv_pyobj()
                if status != "ready":
                    raise ValueError(detail)
                waiting -= 1
            elif dead := self._dead():
                raise RuntimeError(dead)

    def _dead(self) -> str | None:
        for rank, p in enumerate(self.procs, 1):
            code = p.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"tensor-parallel rank {rank} (pid {p.pid}) {how}"
        return None

    def _watch(self) -> None:
        """End this process once a rank is gone: its share of every step is lost, and rank 0
        would otherwise wait in the next all-reduce until the timeout."""
        while (dead := self._dead()) is None:
            if self.closing.wait(WATCH_INTERVAL_S):
                return
        self._stop(dead)

    def _stop(self, dead: str) -> None:
        message = f"{dead}: the engine stops"
        print(f"radixserve: {message}", file=sys.stderr, flush=True)
        if self.death_note is not None:
            Path(self.death_note).write_text(message)
        os._exit(1)

    def _failed(self, error: RuntimeError) -> None:
        """A collective that failed (a peer's socket closed, a timeout): said as the rank
        that exited, once the process is seen gone; otherwise the error as it is."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if dead := self._dead():
                self._stop(dead)
            time.sleep(0.05)
        raise error

    def _send(self, op: str, arg: Any) -> None:
        for sock in self.socks:
            sock.send_pyobj((op, arg))

    def run(self, batch: Batch) -> StepResult:
        return self._step(self.local.run, batch)

    def logits(self, batch: Batch) -> Any:
        return self._step(self.local.logits, batch)

    def _step(self, local: Callable[[Batch], Any], batch: Batch) -> Any:
        """Send ``batch`` to ranks 1..N-1, then run rank 0's part (``local``) of it."""
        self._send("run", batch)
        try:
            return local(batch)
        except RuntimeError as e:
            self._failed(e)
            raise

    def open_host_tier(self, num_slots: int) -> None:
        """Every rank keeps a host tier of ``num_slots`` slots of its own heads' K/V and runs
        each Batch's ``kv_copies`` on it, as rank 0's scheduler process does on its own."""
        self._send("host", num_slots)

    def storage_peers(self) -> Any:
        """Rank 0's StorageTier's link to the other ranks' parts of the storage tier
        (``engine/tp_storage.StoragePeers``); ``open_storage`` then opens those parts."""
        from radixserve.engine.tp_storage import StoragePeers

        return StoragePeers(self._send, self.base, len(self.socks))

    def open_storage(self, settings: Any, digest: str) -> None:
        """Every rank opens its part of the storage tier (after the host tier)."""
        from radixserve.engine.tp_storage import RankStorageArgs

        self._send("storage", RankStorageArgs(settings, digest))

    def close(self) -> None:
        """Stop the ranks and leave the process group (so that another may be made here)."""
        import torch.distributed as dist

        self.closing.set()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(args: RankArgs) -> subprocess.Popen:
    """A rank process (``subprocess``: the scheduler process is a daemon, which may not have
    multiprocessing children)."""
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.engine.tp_worker"],
                            stdin=subprocess.PIPE)  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()
    return proc


def _push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    return sock
