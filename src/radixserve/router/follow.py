"""Keeping a command's workers in step with what discovery lists, for `route`, `epp` and
`kv-indexer` alike: a worker file re-read when it changes, Kubernetes pods (router/kube.py's
watch). Each command says how a worker joins and leaves (as its `POST /workers` and
`DELETE /workers/{url}` do); workers listed otherwise (--worker-urls, the admin API) are never
touched."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from radixserve.router.discovery import DiscoveryConfig, parse_worker_file

log = logging.getLogger("radixserve.router.discovery")

Change = Callable[[str], Awaitable[Any]]  # join(url) or leave(url)


async def follow_file(join: Change, leave: Change, path: str, every: float = 1.0) -> None:
    """Re-read the worker file whenever its modification time or size changes, and make the
    workers it listed last match it; an unreadable or malformed file changes nothing (said once)."""
    seen, listed = None, set()
    while True:
        try:
            st = os.stat(path)
            if (st.st_mtime_ns, st.st_size) != seen:
                seen = (st.st_mtime_ns, st.st_size)
                with open(path) as f:
                    wanted = set(parse_worker_file(f.read()))
                listed = await reconcile(join, leave, listed, wanted, "worker file")
        except (OSError, ValueError) as exc:
            log.warning("worker file %s: %s (workers unchanged)", path, exc)
        await asyncio.sleep(every)


async def follow_pods(join: Change, leave: Change, sets: asyncio.Queue[set[str]]) -> None:
    """Apply each ready set the pod watch publishes (the latest, when several are waiting)."""
    listed: set[str] = set()
    while True:
        wanted = await sets.get()
        while not sets.empty():
            wanted = sets.get_nowait()
        listed = await reconcile(join, leave, listed, wanted, "pod discovery")


async def reconcile(
    join: Change, leave: Change, listed: set[str], wanted: set[str], source: str
) -> set[str]:
    """Workers `source` listed before and no longer does leave; new ones join."""
    for url in sorted(listed - wanted):
        await leave(url)
        log.info("%s: %s left", source, url)
    for url in sorted(wanted - listed):
        await join(url)
        log.info("%s: %s joined", source, url)
    return wanted


class Followers:
    """The discovery a command runs beside its router: built before the router listens (so that
    a missing client or cluster config is a one-line error first), started once it does."""

    def __init__(self, discovery: DiscoveryConfig, worker_file: str | None) -> None:
        self.worker_file, self.watcher, self.tasks = worker_file, None, []
        self.sets: asyncio.Queue[set[str]] = asyncio.Queue()
        if discovery.service_discovery:
            from radixserve.router.kube import PodWatcher, api_client

            loop = asyncio.get_running_loop()
            self.watcher = PodWatcher(
                api_client(),
                discovery,
                lambda urls: loop.call_soon_threadsafe(self.sets.put_nowait, urls),
            )

    def start(self, join: Change, leave: Change) -> None:
        loop = asyncio.get_running_loop()
        if self.worker_file:
            self.tasks.append(loop.create_task(follow_file(join, leave, self.worker_file)))
        if self.watcher is not None:
            self.watcher.start()
            self.tasks.append(loop.create_task(follow_pods(join, leave, self.sets)))

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop.set()
        for task in self.tasks:
            task.cancel()
