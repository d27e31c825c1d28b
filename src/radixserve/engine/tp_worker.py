"""A tensor-parallel rank other than 0 (``python -m radixserve.engine.tp_worker``, started by
``engine/tp_ranks.py`` with its RankArgs pickled on stdin): loads its shard, says ready, then
computes its share of every Batch rank 0 sends, with its own KV pool, host tier and share of the
storage tier (``engine/tp_storage.py``).
"""

from __future__ import annotations

import pickle
import sys
import traceback
from typing import Any

import zmq

from radixserve.engine.procutil import exit_with_parent
from radixserve.engine.tp_ranks import RankArgs, init_group, open_store, rank_config


def main() -> None:
    args: RankArgs = pickle.load(sys.stdin.buffer)
    exit_with_parent(args.parent_pid)  # rank 0's process gone: so is this one
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PUSH)
    ready.connect(f"ipc://{args.base}-ready")
    try:
        init_group(args, open_store(args.store_port))
        runner = _build(args)
    except ValueError as e:  # what rank 0 shows the user: one line
        ready.send_pyobj(("error", f"tensor-parallel rank {args.rank}: {e}"))
        ready.close(linger=2000)
        sys.exit(1)
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{args.base}-tp{args.rank}")
    ready.send_pyobj(("ready", None))
    serve(runner, pull, args)


def _build(args: RankArgs) -> Any:
    from radixserve.model.runner import TorchRunner
    from radixserve.model.tp import TPShard

    return TorchRunner(rank_config(args), args.num_slots, TPShard(args.rank, args.size))


def serve(runner: Any, pull: zmq.Socket, args: RankArgs) -> None:
    """Rank 0's messages in order: ``("run", Batch)`` (its page copies, then its forward),
    ``("host", slots)`` (open the host tier), ``("storage", RankStorageArgs)`` (open the
    storage tier) and the storage tier's ``store_*`` (its part of rank 0's decisions)."""
    host = storage = None
    while True:
        op, arg = pull.recv_pyobj()
        if op == "host":
            from radixserve.model.host_pool import HostKVPool

            host = HostKVPool(runner.kv, arg)
        elif op == "storage":
            from radixserve.engine.tp_storage import RankStorage

            storage = RankStorage(arg, args.rank, host, args.base)
        elif op.startswith("store_") and storage is not None:
            storage.handle(op, arg)
        elif op == "run":
            if arg.kv_copies and host is not None:
                host.apply(arg.kv_copies)
            try:
                runner.forward_shard(arg)
            except ValueError:  # rank 0 refuses the same batch, before any collective
                traceback.print_exc()


if __name__ == "__main__":
    main()
