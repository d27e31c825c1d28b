"""Checks at the door: a scheduler config or a request that can never run is refused here.

Each failure is a ValueError that says what is wrong, so the server can answer with a 4xx.
"""

from __future__ import annotations

from radixserve.config import SchedulerConfig
from radixserve.sched.request import Req, ReqState


def check_config(cfg: SchedulerConfig, page_size: int) -> None:
    if cfg.max_running_requests < 1:
        raise ValueError("max_running_requests must be >= 1")
    # (a setting left to the device, None, is filled in by SchedulerConfig.for_device)
    if cfg.max_prefill_tokens is not None and cfg.max_prefill_tokens < page_size:
        raise ValueError(f"max_prefill_tokens must hold at least one page ({page_size} tokens)")
    if cfg.chunked_prefill_size not in (None, -1) and cfg.chunked_prefill_size < page_size:
        raise ValueError(f"chunked_prefill_size must be -1 (off) or >= page_size ({page_size})")
    if cfg.max_wait_ms is not None and cfg.max_wait_ms < 0:
        raise ValueError("max_wait_ms must be >= 0")
    if cfg.in_batch_prefix_threshold < 0:
        raise ValueError("in_batch_prefix_threshold must be >= 0 (0: off)")


def check_request(req: Req, context_length: int | None, pool: int, page_size: int) -> None:
    """A fresh request whose prompt plus max_new_tokens fits the context and the KV pool (so
    it can always finish, if need be alone after retracting every other request)."""
    if req.state is not ReqState.WAITING or req.output_ids or req.kv_len:
        raise ValueError(f"request {req.rid!r} is not fresh (state {req.state.value})")
    if not req.input_ids:
        raise ValueError(f"request {req.rid!r} has an empty prompt")
    prompt, new = len(req.input_ids), req.sampling.max_new_tokens
    if context_length is not None and prompt + new > context_length:
        raise ValueError(
            f"request {req.rid!r}: prompt ({prompt} tokens) + max_new_tokens ({new}) exceeds "
            f"the context length ({context_length})"
        )
    if -(-(prompt + new) // page_size) * page_size > pool:
        raise ValueError(
            f"request {req.rid!r}: prompt ({prompt} tokens) + max_new_tokens ({new}) needs more "
            f"KV slots than the pool holds ({pool})"
        )
