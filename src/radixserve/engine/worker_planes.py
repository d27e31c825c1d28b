"""The scheduler process's optional planes, built once at start: the KV-event publisher on the
tree, the host tier's bytes and the storage tier of a real engine."""

from __future__ import annotations

from typing import Any

from radixserve.engine.kv_events import KVEventPlane
from radixserve.sched.scheduler import Scheduler


def open_kv_events(engine_config: Any, scheduler: Scheduler) -> KVEventPlane | None:
    """The tracker on the scheduler's tree and the publisher (its sockets bound here, so that an
    address in use fails the start)."""
    if engine_config.kv_events is None or not engine_config.kv_events.enable_kv_cache_events:
        return None
    return KVEventPlane(engine_config.kv_events, scheduler.cache)


def open_storage_tier(
    settings: Any, info: dict[str, Any], runner: Any, pool: Any, model_config: Any, meter: Any
) -> Any:
    """The storage tier of a real engine: its namespace names the model (its name and a digest
    of its weight files) and the KV layout, so only engines whose pages are byte-compatible
    share keys (two fine-tunes of one name do not). At --tp-size N the layout is one rank's
    (its KV heads) and each rank's keys name its heads; every rank opens its part here."""
    from radixserve.cache.hashing import KVNamespace
    from radixserve.engine.storage_settings import weights_identity
    from radixserve.engine.storage_tier import StorageTier
    from radixserve.kvstore.storage import head_part
    from radixserve.modelfiles.locate import resolve_model_dir

    layers, _, _, heads, dim = pool.kv.shape
    model = f"{info.get('model')}@{weights_identity(resolve_model_dir(model_config))}"
    ns = KVNamespace(model, str(info.get("kv_cache_dtype")), int(layers), int(heads), int(dim),
                     settings.chunk_size)  # fmt: skip
    size = model_config.tp_size
    if size == 1:
        return StorageTier(settings, ns, pool, meter=meter)
    parts = [head_part(r, int(heads)) for r in range(size)]
    tier = StorageTier(settings, ns, pool, meter=meter, parts=parts, peers=runner.storage_peers())
    runner.open_storage(settings, ns.digest())  # after rank 0's opened: a bad config fails there
    return tier


def open_host_pool(runner: Any, scheduler: Scheduler) -> Any:
    """The host tier's bytes, shaped like the runner's device pool (None without a tier, or
    for a simulated runner, which has no bytes to move)."""
    host, pool = scheduler.kv.host, getattr(runner, "kv", None)
    if host is None or pool is None:
        return None
    from radixserve.model.host_pool import HostKVPool

    if hasattr(runner, "open_host_tier"):  # tensor-parallel: every rank keeps its own
        runner.open_host_tier(host.total)
    return HostKVPool(pool, host.total)
