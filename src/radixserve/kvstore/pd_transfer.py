"""The bytes of prefill/decode disaggregation: a prompt's KV rows written from a prefill engine's
pool into the slots a decode engine reserved, over Mooncake's transfer engine (TCP or RDMA).

Both pools are one contiguous ``[layers, 2, slots, heads, dim]`` buffer (model/kv_pool.py), so a
token's K (or V) of one layer is one row at ``((layer * 2 + kv) * num_slots + slot) * row_bytes``.
The address arithmetic is plain numbers; the engine hands in each pool's ``PoolLayout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Where a KV pool lives in memory and how it is shaped (sent by the decode engine)."""

    base: int  # address of the pool's first byte
    num_layers: int
    num_slots: int
    row_bytes: int  # one token's K (or V) of one layer: heads * dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.num_layers * 2 * self.num_slots * self.row_bytes

    def same_rows(self, other: PoolLayout) -> bool:
        return (self.num_layers, self.row_bytes) == (other.num_layers, other.row_bytes)


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both slot lists go up by one together, so
    a prompt whose slots were allocated in order moves in a few large writes."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def spans(
    src: PoolLayout, dst: PoolLayout, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """Source addresses, destination addresses and lengths that copy the rows of ``src_slots``
    (every layer, K and V) into ``dst_slots``. ValueError if the pools' rows differ."""
    if not src.same_rows(dst) or len(src_slots) != len(dst_slots):
        raise ValueError(
            f"KV layouts differ: prefill {src.num_layers} layers x {src.row_bytes} B/row for "
            f"{len(src_slots)} tokens, decode {dst.num_layers} x {dst.row_bytes} for "
            f"{len(dst_slots)} (the two engines must serve the same model and KV dtype)"
        )
    srcs, dsts, lens = [], [], []
    row = src.row_bytes
    for s0, d0, n in runs(src_slots, dst_slots):
        for plane in range(src.num_layers * 2):
            srcs.append(src.base + (plane * src.num_slots + s0) * row)
            dsts.append(dst.base + (plane * dst.num_slots + d0) * row)
            lens.append(n * row)
    return srcs, dsts, lens


class MooncakeTransfer:
    """One Mooncake transfer engine with one pool registered: the prefill side writes from it,
    the decode side is written into. ``session`` is what a peer names it by (host:rpc port)."""

    def __init__(self, host: str, layout: PoolLayout, device: str | None = None) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ValueError(
                "--disaggregation-transfer-backend mooncake needs Mooncake's transfer engine: "
                'pip install "radixserve[mooncake]"'
            ) from e
        self.engine = TransferEngine()
        protocol = "rdma" if device else "tcp"
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, device or "") != 0:
            raise ValueError(f"Mooncake's transfer engine did not start on {host} ({protocol})")
        if self.engine.register_memory(layout.base, layout.nbytes) != 0:
            raise ValueError("Mooncake's transfer engine could not register the KV pool")
        self.layout = layout
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def write(self, peer: str, dst: PoolLayout, src_slots: Any, dst_slots: Any) -> None:
        """Copy the rows of ``src_slots`` into ``peer``'s ``dst_slots``; RuntimeError if the
        transfer engine reports a failure (the peer gone, say)."""
        srcs, dsts, lens = spans(self.layout, dst, list(src_slots), list(dst_slots))
        if srcs and self.engine.batch_transfer_sync_write(peer, srcs, dsts, lens) != 0:
            raise RuntimeError(f"KV transfer to {peer} failed")
