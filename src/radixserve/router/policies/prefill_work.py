"""kv_aware's measure of a worker's prefill work for a prompt, in tokens: what it must compute,
what it loads from a lower tier weighed by the tier's load-to-prefill ratio; also the prompt's
size and the most of it a worker caching whole blocks can serve. Pure (no I/O)."""

# Lower tiers (issue 28). Tokens a worker can load rather than compute cost their load time in
# prefill tokens, at the load-to-prefill ratio the worker reports for the tier they come from
# (seconds to load a token over seconds to prefill one, the engine's running means of its own
# timings: engine/load_meter.py; WorkerView.kv_load_ratio, kv_store_load_ratio). host(w): the
# leading tokens it holds on device or in its host tier, as its KV events' `medium` announces
# them (HostTier); store(w): those in a KV store every worker reads (Mooncake Store, as its
# master's metadata says; TierSource). A prefix loads from the nearest tier holding it (a
# prompt of P tokens, cached of them on device):
#
#     near = max(cached, host),  held = max(near, store)
#     (P - held) + r_host(w) * (near - cached) + r_store(w) * (held - near)
#
# A worker that reports no host ratio is charged DEFAULT_LOAD_RATIO (see there); no store
# ratio, the larger of that and its host ratio (a store load lands in the host tier and is
# copied on from there: it never costs less than a host load). Llumnix counts a
# store hit as a hit (ratio 0); with a ratio the device holder still wins a tie, and a worker
# that can load a prefix cheaply takes it over a busier one that holds it on device. While a
# source cannot answer (its service down) it counts for no worker: the score is the device's.

from __future__ import annotations

from radixserve.router.policies.base import RequestView
from radixserve.router.policies.tree_keys import units

DEFAULT_LOAD_RATIO = 0.1
"""Load-to-prefill ratio charged for a worker that reports none: issue 27's target for a store
load (<= 0.1x the recompute time of a 2,000-token prefix). Not 0 (Llumnix's "a store hit is a
hit"): then a worker holding the prefix on device and one that must fetch it would tie, and the
fetch is never free; not larger: a guess above the target would send prefixes that are cheap to
load back to recomputation."""


def prefill_work(
    size: int,
    cached: int,
    loadable: int,
    ratio: float | None,
    store: int = 0,
    store_ratio: float | None = None,
) -> float:
    """A worker's prefill work for a prompt of ``size`` tokens, in tokens: what it must compute,
    plus what it loads from its host tier (``loadable``: leading tokens on device or there)
    weighed by ``ratio`` (None: DEFAULT_LOAD_RATIO) and what only a store holds (``store``)
    weighed by ``store_ratio`` (None: the larger of the default and the host's); device-cached
    tokens cost nothing."""
    cached = min(cached, size)
    near = min(max(cached, loadable), size)
    held = min(max(near, store), size)
    host_ratio = DEFAULT_LOAD_RATIO if ratio is None else ratio
    far_ratio = max(DEFAULT_LOAD_RATIO, host_ratio) if store_ratio is None else store_ratio
    return size - held + host_ratio * (near - cached) + far_ratio * (held - near)


def servable(size: int, block_size: int) -> int:
    """The most of a prompt of ``size`` tokens a worker caching whole blocks of ``block_size``
    can serve from cache: its full blocks before the last token, which the engine always
    computes (vLLM caps a hit at size - 1 tokens, block-aligned; so does our scheduler)."""
    return max(0, (size - 1) // block_size * block_size)


def prompt_size(request: RequestView) -> int:
    """Prompt length in tokens (key units when the router has no token ids)."""
    return len(request.token_ids) if request.token_ids is not None else units(request.key)
