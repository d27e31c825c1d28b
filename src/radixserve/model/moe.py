"""Qwen3-MoE's sparse MLP: the router (softmax over experts, top-k, renormalised as the config
says) and the experts, each run once on just the rows routed to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from radixserve.model.arch import MoEArch


class Linear(Protocol):
    """What the block needs of a projection: the engine's ``llama.Linear`` (named by shape, so
    this module does not import the model that imports it)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class MoEBlock:
    """``router`` maps hidden rows to one logit per expert; ``experts[e]`` is expert e's fused
    gate/up and its down projection (the engine's ``Linear``: the same matmul path as the dense
    MLP, our CPU kernels included)."""

    __slots__ = ("moe", "router", "experts")

    def __init__(self, moe: MoEArch, router: Linear, experts: Sequence[tuple[Linear, Linear]]):
        if len(experts) != moe.num_experts:
            raise ValueError(f"{len(experts)} experts loaded, config says {moe.num_experts}")
        self.moe = moe
        self.router = router
        self.experts = list(experts)

    def __call__(
        self, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The block's output for rows ``h`` ``[T, hidden]``; ``act`` is silu(gate) * up of a
        fused gate/up output."""
        weights, chosen = self.route(h)
        k = self.moe.top_k
        flat = chosen.flatten()
        # the (row, choice) pairs grouped by expert: each expert multiplies only its own rows
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        scale = weights.flatten()[order].unsqueeze(1)
        rows = order // k
        out = torch.zeros_like(h)
        start = 0
        for (gate_up, down), n in zip(self.experts, counts):
            if n:
                sel = rows[start : start + n]
                y = down(act(gate_up(h[sel])))
                out.index_add_(0, sel, y.mul_(scale[start : start + n]))
                start += n
        return out

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` in ``h``'s dtype, expert ids ``[T, k]``): the top-k of the
        softmax (in float32, as transformers computes it), renormalised when the config says."""
        probs = torch.softmax(self.router(h).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), chosen
