"""The KV tensor pool: every layer's keys and values for every token slot the scheduler hands out.

Slot ids come from the scheduler's allocator (``cache/pool.py``); this module only stores tensors.
"""

from __future__ import annotations

import torch


class KVPool:
    """K and V of all layers in one tensor ``[layers, 2, num_slots, num_kv_heads, head_dim]``.

    Slot-major rows keep one token's heads together, so a gather by slot id copies whole rows.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scratch: bool = False,
    ) -> None:
        """``scratch``: one more slot, ``scratch_slot`` (``num_slots``), past the scheduler's,
        which padding rows of a CUDA graph write and read so they never touch a real one."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.scratch_slot = num_slots if scratch else None
        shape = (num_layers, 2, num_slots + int(scratch), num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """What one token slot costs, for sizing ``num_slots`` to a memory budget."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * num_kv_heads * head_dim * itemsize

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` of shape ``[n, heads, dim]`` at ``slots`` (``[n]``, int64)."""
        self.kv[layer, 0].index_copy_(0, slots, k.to(self.kv.dtype))
        self.kv[layer, 1].index_copy_(0, slots, v.to(self.kv.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape ``S``) as two tensors ``[*S, heads, dim]``."""
        flat = slots.reshape(-1)
        k = self.kv[layer, 0].index_select(0, flat)
        v = self.kv[layer, 1].index_select(0, flat)
        tail = self.kv.shape[3:]
        return k.view(*slots.shape, *tail), v.view(*slots.shape, *tail)

    # -- page copies between tiers (kvstore) ---------------------------------------------------
    def read_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K and V at ``slots`` (``[n]``, int64): ``[layers, 2, n, heads, dim]``."""
        return self.kv.index_select(2, slots)

    def write_slots(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Store ``data`` (as ``read_slots`` returns it, any device) at ``slots``."""
        self.kv.index_copy_(2, slots, data.to(self.kv.device, non_blocking=True))
