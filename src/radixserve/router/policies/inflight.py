"""kv_aware's record of prompts dispatched to each worker and not yet complete, as block keys:
held (or about to be) whatever the KV index says. Pure (no I/O)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from radixserve.router.kvindex.block_index import leading_held

INFLIGHT_BLOCK = 16
"""Block size for in-flight prompts on a worker whose events have not told one yet."""


class InFlightBlocks:
    """Per worker, the block keys of prompts dispatched to it and not yet complete: held (or
    about to be) whatever the index says, since a running request's KV cannot be evicted."""

    def __init__(self) -> None:
        self._counts: dict[Hashable, dict[int, int]] = {}
        self._sizes: dict[Hashable, int] = {}
        self._requests: dict[Hashable, dict[int, list[int]]] = {}

    def add(self, worker: Hashable, request: int, block_size: int, keys: list[int]) -> None:
        if self._sizes.setdefault(worker, block_size) != block_size:
            return  # the worker's block size changed under in-flight prompts: skip this one
        self._requests.setdefault(worker, {})[request] = keys
        counts = self._counts.setdefault(worker, {})
        for k in keys:
            counts[k] = counts.get(k, 0) + 1

    def remove(self, worker: Hashable, request: int) -> None:
        keys = self._requests.get(worker, {}).pop(request, None)
        if keys is None:
            return
        counts = self._counts[worker]
        for k in keys:
            if counts[k] == 1:
                del counts[k]
            else:
                counts[k] -= 1
        if not self._requests[worker]:
            self.forget(worker)

    def forget(self, worker: Hashable) -> None:
        for table in (self._counts, self._sizes, self._requests):
            table.pop(worker, None)

    def block_size(self, worker: Hashable) -> int | None:
        return self._sizes.get(worker)

    def leading_held(self, worker: Hashable, keys: Sequence[int]) -> int:
        """Leading keys of `keys` some in-flight prompt on `worker` shares."""
        return leading_held(keys, self._counts.get(worker, {}))
