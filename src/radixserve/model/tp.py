"""Tensor parallelism's arithmetic: which slice of each weight a rank keeps, the shape of a rank's
shard of the network, and the all-reduce that sums the row-parallel layers' partial outputs.

The split is Megatron's: q/k/v and gate/up are column-parallel (a rank keeps whole attention
heads, KV heads included, and a contiguous block of the MLP's intermediate columns), o_proj and
down_proj are row-parallel (a rank multiplies its slice of their inputs; the ranks' partial sums
are all-reduced, so every rank ends each layer with the full hidden state). Embeddings and the
LM head stay whole on every rank: a rank looks its tokens up without a collective, and only rank
0 (the one that samples) computes logits, so there is no logits all-gather on the step's path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from radixserve.model.arch import ModelArch


@dataclass(frozen=True, slots=True)
class TPShard:
    """This process's place among ``size`` ranks; ``size`` 1 is the whole model (no collective)."""

    rank: int = 0
    size: int = 1

    @property
    def lm_head(self) -> bool:
        """Whether this rank computes logits (rank 0 samples; the others never need them)."""
        return self.rank == 0

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """A column-parallel layer's slice: this rank's block of output rows (and bias)."""
        if self.size == 1:
            return weight
        return weight.chunk(self.size, dim=0)[self.rank].contiguous()

    def cols(self, weight: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's slice: this rank's block of input columns."""
        if self.size == 1:
            return weight
        return weight.chunk(self.size, dim=1)[self.rank].contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x`` (in place): a row-parallel layer's full output."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x


def tp_problem(arch: ModelArch, size: int) -> str | None:
    """Why ``arch`` cannot be split over ``size`` ranks (heads, KV heads and the MLP's width
    must divide evenly: a rank keeps whole heads), or None."""
    if size == 1:
        return None
    parts = (("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads),
             ("MLP columns (intermediate_size)", arch.intermediate_size))  # fmt: skip
    if arch.moe is not None:  # each expert's columns split as the dense MLP's
        parts += (("expert MLP columns (moe_intermediate_size)", arch.moe.intermediate_size),)
    for what, n in parts:
        if n % size:
            return f"--tp-size {size}: the model has {n} {what}, not divisible by {size}"
    return None


def shard_arch(arch: ModelArch, size: int) -> ModelArch:
    """The shape one rank computes: its heads, KV heads and MLP columns (head_dim, hidden size
    and vocabulary unchanged)."""
    if size == 1:
        return arch
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // size,
        num_kv_heads=arch.num_kv_heads // size,
        intermediate_size=arch.intermediate_size // size,
    )
