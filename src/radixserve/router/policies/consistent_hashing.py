"""`--policy consistent_hashing`: session affinity on a request header (`--session-header`,
X-Session-Id by default), as smg's policy of that name. Rendezvous hashing (highest random
weight): each key goes to the healthy worker whose hash with it is highest, so adding or
removing a worker moves only the keys that worker wins or held. Requests without the header
hash their prompt's prefix key instead, so they still land somewhere stable. Pure: no I/O."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from radixserve.router.policies.base import RequestView, RouterPolicy, WorkerView, healthy_indices


def _weight(key: bytes, worker_id: object) -> bytes:
    return hashlib.blake2b(key + b"\0" + str(worker_id).encode(), digest_size=8).digest()


class ConsistentHashingPolicy(RouterPolicy):
    """The healthy worker with the highest rendezvous weight for the request's session key."""

    name = "consistent_hashing"

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        key = request.routing_key or request.key[:256]
        return max(healthy_indices(workers), key=lambda i: _weight(key, workers[i].id))
