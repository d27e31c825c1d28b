"""How much could precise KV knowledge add to routing hits? (issue 12, acceptance 4)

Replays the kv_aware sweep's workloads (kv_aware_sweep.py: the committed Mooncake trace, and
multi-turn chat) on the simulated fleet, and at every routing decision reads a precise index of
what each engine holds (fed by the engines' own KV events), so that for each policy it reports:

  hit           the engines' prefix hit rate (what the sweep reports)
  best held     prompt tokens the best-placed engine held at dispatch (share of all prompt
                tokens): what a router with perfect knowledge could have hit at that moment
  chosen held   prompt tokens the chosen engine held at dispatch
  headroom      best held - chosen held: the most precise knowledge can add to this
                policy's decisions, with everything else (retention) unchanged
  copies        blocks held by more than one engine, as a share of all blocks held (sampled
                every SAMPLE_EVERY decisions): KV the fleet spends on duplicates rather than
                on more prefixes. Near zero, no routing can free room for more hits.

Beside cache_aware and kv_aware it runs three diagnostic policies, defined here and registered
only in this process (they are not router policies a user can pick):

  cache_aware+upgrade   cache_aware, except that when the precise index says an eligible worker
                        holds at least a quarter of the prompt more than cache_aware's pick, the
                        request goes there: the guess corrected by the truth.
  kv_aware-placement    kv_aware without its placement while evicting (policies/eviction_placement.py): a
                        request every eligible worker holds equally goes where the score sends
                        it (the least queued worker), evicting or not.
  kv_aware+held         kv_aware with that placement at every size, evicting or not: such a
                        request goes to the worker holding the fewest tokens (plus half its
                        queued prefill), the precise counterpart of cache_aware's smallest tree.

    python benchmarks/kv_aware_headroom.py [--points chat:0.1 mooncake:0.5] [--subsample S ...]

Simulated on a virtual clock, so the figures repeat exactly on any machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_line  # noqa: E402
from kv_aware_sweep import PRESET, requests  # noqa: E402
from radixserve.config import CacheConfig  # noqa: E402
from radixserve.router.kvindex.block_index import BlockIndex, InMemoryIndex, keys_by_size  # noqa: E402
from radixserve.router.policies.base import RequestView, RouterPolicy, WorkerView, healthy_indices  # noqa: E402
from radixserve.router.policies.cache_aware import CacheAwarePolicy  # noqa: E402
from radixserve.router.policies.eviction_placement import EvictionPlacement  # noqa: E402
from radixserve.router.policies.kv_aware import KvAwarePolicy  # noqa: E402
from radixserve.router.policies.prefill_work import prompt_size  # noqa: E402
from radixserve.router.policies.registry import register  # noqa: E402
from radixserve.sim.cluster import ClusterConfig, ClusterSim  # noqa: E402
from radixserve.sim.costmodel import get_cost_model  # noqa: E402
from radixserve.sim.report import max_over_mean, percentile  # noqa: E402

UPGRADE_SHARE = 0.25
SAMPLE_EVERY = 16


def held_now(
    index: BlockIndex, workers: Sequence[WorkerView], request: RequestView
) -> dict[Hashable, int]:
    """Leading prompt tokens each worker holds, from the precise index."""
    if not request.token_ids:
        return {}
    keys_for = keys_by_size(request.token_ids, request.kv_namespace)
    return index.prefix_tokens([w.id for w in workers], keys_for)


class Recorder:
    """Per decision: prompt tokens, the most any worker held, what the chosen one held."""

    def __init__(self) -> None:
        self.prompt = self.best = self.chosen = 0
        self.decisions = self.held_blocks = self.distinct_blocks = 0

    def record(self, held: dict[Hashable, int], size: int, chosen: Hashable) -> None:
        self.prompt += size
        self.best += max(held.values(), default=0)
        self.chosen += held.get(chosen, 0)

    def sample(self, index: InMemoryIndex) -> None:
        """Every SAMPLE_EVERY decisions, add up blocks held and distinct blocks held."""
        self.decisions += 1
        if self.decisions % SAMPLE_EVERY == 0:
            self.held_blocks += sum(index.blocks().values())
            self.distinct_blocks += index.distinct_blocks()

    def copies(self) -> float:
        """Share of held blocks that are a second (or later) copy of a block."""
        return 1.0 - self.distinct_blocks / self.held_blocks if self.held_blocks else 0.0


def probed(base: type[RouterPolicy], name: str) -> type[RouterPolicy]:
    """`base`, with a precise index beside it (the simulator feeds any policy's BlockIndex)
    and every decision recorded against it."""

    class Probed(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            if not isinstance(getattr(self, "index", None), BlockIndex):
                self.index = InMemoryIndex()
            self.recorder = Recorder()

        def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
            pick = super().select(workers, request, now)
            held = held_now(self.index, workers, request)
            self.recorder.record(held, prompt_size(request), workers[pick].id)
            if isinstance(self.index, InMemoryIndex):
                self.recorder.sample(self.index)
            return pick

    register(name)(Probed)
    return Probed


class CacheAwareUpgrade(CacheAwarePolicy):
    """cache_aware corrected by the truth: see the module docstring."""

    index: BlockIndex

    def select(self, workers: Sequence[WorkerView], request: RequestView, now: float) -> int:
        pick = super().select(workers, request, now)
        healthy = healthy_indices(workers)
        floor = min(workers[i].load for i in healthy)
        eligible = [i for i in healthy if self._within_balance(workers[i].load, floor)]
        held = held_now(self.index, [workers[i] for i in eligible], request)
        best = max(eligible, key=lambda i: (held.get(workers[i].id, 0), -workers[i].load))
        gain = held.get(workers[best].id, 0) - held.get(workers[pick].id, 0)
        return best if gain > UPGRADE_SHARE * prompt_size(request) else pick


class NoPlacement(EvictionPlacement):
    def place(self, *args: object) -> int | None:
        return None


class AlwaysEvicting(EvictionPlacement):
    def evicting(self, worker: Hashable, now: float) -> bool:
        return True


class KvAwareNoPlacement(KvAwarePolicy):
    """kv_aware without its placement while evicting: see the module docstring."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._evictions = NoPlacement(self.index, self._pending, self._shares)


class KvAwareHeld(KvAwarePolicy):
    """kv_aware placing by holdings whether or not the fleet evicts."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._evictions = AlwaysEvicting(self.index, self._pending, self._shares)


POLICIES = {
    "cache_aware": probed(CacheAwarePolicy, "probe:cache_aware"),
    "kv_aware": probed(KvAwarePolicy, "probe:kv_aware"),
    "cache_aware+upgrade": probed(CacheAwareUpgrade, "probe:cache_aware+upgrade"),
    "kv_aware-placement": probed(KvAwareNoPlacement, "probe:kv_aware-placement"),
    "kv_aware+held": probed(KvAwareHeld, "probe:kv_aware+held"),
}


def one(job: tuple[str, float, str, int]) -> dict:
    workload, fraction, label, subsample = job
    kv = int(get_cost_model(PRESET).kv_capacity_tokens * fraction)
    sim = ClusterSim(
        ClusterConfig(engines=8, router=f"probe:{label}", preset=PRESET),
        cache_config=CacheConfig(max_total_tokens=kv),
    )
    res = sim.run(
        requests(workload, None, subsample),
        label,
        block_tokens=512 if workload == "mooncake" else None,
    )
    assert res.num_unfinished == 0, "a request was lost"
    rec = sim.policy.recorder
    return {
        "workload": workload, "kv": kv, "policy": label, "seed": subsample,
        "hit": res.hit_rate, "best": rec.best / rec.prompt, "chosen": rec.chosen / rec.prompt,
        "copies": rec.copies(), "ttft_p99": percentile(sorted(res.ttft), 99),
        "busy": max_over_mean([e.busy_s for e in res.engines]),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--points", nargs="+", default=["chat:0.1", "mooncake:0.5"],
        help="WORKLOAD:FRACTION of the preset's KV pool per engine",
    )  # fmt: skip
    parser.add_argument("--subsample", nargs="+", type=int, default=[0])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    points = []
    for point in args.points:
        workload, _, fraction = point.partition(":")
        try:
            share = float(fraction)
        except ValueError:
            share = 0.0
        if workload not in ("chat", "mooncake") or not 0 < share <= 1:
            parser.error(f"--points: {point!r} is not chat:F or mooncake:F with 0 < F <= 1")
        points.append((workload, share))
    print(machine_line())
    print("fleet: 8 x", PRESET, "(simulated, virtual clock)")
    jobs = [(w, f, p, s) for w, f in points for s in args.subsample for p in POLICIES]
    print(
        f"{'workload':9} {'KV/engine':>10} {'drop':>4}  {'policy':22} {'hit':>6} "
        f"{'best held':>9} {'chosen held':>11} {'headroom':>8} {'copies':>6} {'TTFT p99 s':>10} "
        f"{'busy':>5}"
    )
    with ProcessPoolExecutor(args.jobs) as pool:
        for r in pool.map(one, jobs):
            drop = f"s{r['seed']}" if r["seed"] else "-"
            print(
                f"{r['workload']:9} {r['kv']:>10,} {drop:>4}  {r['policy']:22} {r['hit']:6.1%} "
                f"{r['best']:9.1%} {r['chosen']:11.1%} {(r['best'] - r['chosen']) * 100:+7.2f}pt "
                f"{r['copies']:6.1%} {r['ttft_p99']:10.2f} {r['busy']:5.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
