"""The `--policy` registry: every policy's class under its name. It imports the implementations
(they import only the interface in base.py, never this module), so the arrows run one way."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.router.policies.base import RouterPolicy
from radixserve.router.policies.cache_aware import CacheAwarePolicy
from radixserve.router.policies.config import CachePolicyConfig
from radixserve.router.policies.consistent_hashing import ConsistentHashingPolicy
from radixserve.router.policies.kv_aware import KvAwarePolicy
from radixserve.router.policies.least_load import LeastLoadPolicy
from radixserve.router.policies.power_of_two import PowerOfTwoPolicy
from radixserve.router.policies.random_choice import RandomPolicy
from radixserve.router.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[RouterPolicy]] = {
    cls.name: cls
    for cls in (
        RoundRobinPolicy,
        RandomPolicy,
        PowerOfTwoPolicy,
        LeastLoadPolicy,
        ConsistentHashingPolicy,
        CacheAwarePolicy,
        KvAwarePolicy,
    )
}


def policy_names() -> tuple[str, ...]:
    """The `--policy` choices, sorted."""
    return tuple(sorted(POLICIES))


def register(name: str) -> Callable[[type[RouterPolicy]], type[RouterPolicy]]:
    """Class decorator for a policy defined outside this package (a benchmark's probe): make
    it selectable as `name` too."""

    def wrap(cls: type[RouterPolicy]) -> type[RouterPolicy]:
        cls.name = name
        POLICIES[name] = cls
        return cls

    return wrap


def create_policy(
    name: str, config: CachePolicyConfig | None = None, seed: int = 0
) -> RouterPolicy:
    """Build the policy registered as `name`."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](config, seed)
