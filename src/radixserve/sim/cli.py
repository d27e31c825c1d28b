"""`radixserve sim`: run a workload through a simulated fleet under one or more router and
schedule policies, and print one comparison table (plus JSON and a PNG plot on request)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from typing import Any

from radixserve.config import (
    CacheConfig,
    SchedulerConfig,
    add_check,
    add_dataclass_args,
    bound_problem,
    from_args,
    writable_file,
)
from radixserve.router.policies.registry import POLICIES
from radixserve.sched.validate import check_config
from radixserve.sim.cluster import ClusterConfig, host_tier_tokens, simulate
from radixserve.sim.costmodel import COST_MODELS, get_cost_model
from radixserve.sim.pd import PDConfig, parse_split, simulate_pd
from radixserve.sim.report import SimResult, format_table
from radixserve.sim.runner import SimRunner
from radixserve.sim.slo import SloConfig
from radixserve.sim.workload_args import (
    add_workload_args,
    finite,
    make_requests,
    workload_config,
)
from radixserve.sim.workloads import block_hit_rate, ideal_prefix_hit_rate

# flags that take several values: every combination is one run of the comparison
_SWEPT = {
    "router": "cache_aware",
    "schedule_policy": "lpm",
    "max_wait_ms": None,
    "radix_eviction_policy": "lru",
    "pd": None,  # aggregated: every engine prefills and decodes
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `sim` subcommand."""
    parser = subparsers.add_parser(
        "sim",
        help="simulate a fleet of engines behind a router, without a GPU",
        description=(
            "Discrete-event simulation of N engines (the real scheduler and radix cache, a cost "
            "model instead of a GPU) behind a router policy. Several values of --router, "
            "--schedule-policy, --max-wait-ms or --radix-eviction-policy run every combination "
            "and compare them. The "
            "KV pool defaults to what the preset's GPU holds beside the weights. Lower tiers: "
            "--enable-hierarchical-cache gives each engine a host tier (the preset's host "
            "memory per GPU, or --hicache-size / --hicache-ratio), --kv-store-gb a fleet-wide "
            "KV store; copies cost the preset's bandwidths (--host-bandwidth-gbs, "
            "--store-bandwidth-gbs, --store-latency-ms override them), and the report splits "
            "hits and TTFT by tier. --pd X:Y runs X prefill and Y decode engines (X + Y = "
            "--engines; several values and `none`, the aggregated fleet, compare them); "
            "--slo-ttft-ms and --slo-tbt-ms count goodput."
        ),
    )
    add_workload_args(parser)
    add_dataclass_args(parser, ClusterConfig, "cluster", check=False)
    add_dataclass_args(parser, SchedulerConfig, "engine scheduler", check=False)
    add_dataclass_args(parser, CacheConfig, "engine cache", check=False)
    pd = parser.add_argument_group("prefill and decode apart, SLOs")
    pd.add_argument(
        "--pd",
        nargs="+",
        type=_split,
        default=[None],
        metavar="X:Y",
        help="X prefill and Y decode engines (none: aggregated, the default); several compare",
    )
    add_dataclass_args(parser, PDConfig, "", check=False, group=pd)
    add_dataclass_args(parser, SloConfig, "", check=False, group=pd)
    for action in parser._actions:
        if action.dest in _SWEPT:
            action.nargs, action.default = "+", [_SWEPT[action.dest]]
        if action.dest == "router":
            action.choices = sorted(POLICIES)
        if action.dest == "preset":
            action.choices = sorted(COST_MODELS)
        if action.dest == "max_total_tokens":
            action.default = None
        if action.dest == "max_wait_ms":
            action.type, action.metavar = _ms_or_none, "MS"
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", type=writable_file, help="write the results as JSON")
    out.add_argument(
        "--plot", metavar="PNG", type=writable_file, help="plot the comparison (needs matplotlib)"
    )
    out.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar"
    )
    add_check(parser, _configs)  # every setting is checked before the simulation starts
    parser.set_defaults(run=run)
    return parser


def _split(text: str) -> tuple[int, int] | None:
    try:
        return parse_split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ms_or_none(text: str) -> float | None:
    """``--max-wait-ms none`` sweeps the unbounded case beside bounded ones."""
    if text.lower() == "none":
        return None
    ms = float(text)
    meta = SchedulerConfig.__dataclass_fields__["max_wait_ms"].metadata
    if problem := bound_problem(ms, meta):
        raise argparse.ArgumentTypeError(problem)
    return ms


def _configs(args: argparse.Namespace) -> tuple[ClusterConfig, CacheConfig, SchedulerConfig]:
    """The fleet, its engines' cache and scheduler (swept settings at their defaults: each swept
    value was checked alone) and the workload's config; ValueError says what is wrong."""
    if args.plot:
        from radixserve.sim.plot import import_pyplot

        try:
            import_pyplot()
        except RuntimeError as e:  # --plot without matplotlib
            raise ValueError(str(e)) from None
    plain = {k: v for k, v in vars(args).items() if k not in _SWEPT}
    base = argparse.Namespace(**plain, **{k: v for k, v in _SWEPT.items()})
    cluster = from_args(ClusterConfig, base)
    if args.max_total_tokens is None:
        base.max_total_tokens = get_cost_model(cluster.preset).kv_capacity_tokens
    cache = from_args(CacheConfig, base)
    sched = from_args(SchedulerConfig, base)
    check_config(sched, cache.page_size)
    workload_config(args)
    pd, _ = from_args(PDConfig, args), from_args(SloConfig, args)
    if not any(args.pd) and pd != PDConfig():
        raise ValueError("--decode-router and --transfer-bandwidth-gbs set how --pd X:Y runs; "
                         "no --pd split was given")  # fmt: skip
    for split in filter(None, args.pd):
        if sum(split) != cluster.engines:
            raise ValueError(f"--pd {split[0]}:{split[1]} has {sum(split)} engines, --engines "
                             f"{cluster.engines}: a comparison keeps the fleet's size")  # fmt: skip
        if cache.enable_hierarchical_cache or cluster.tiers.kv_store_gb:
            raise ValueError("--pd runs without lower KV tiers (--kv-store-gb, "
                             "--enable-hierarchical-cache)")  # fmt: skip
    return cluster, cache, sched


def _runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(label, overrides) for every combination of the swept flags."""
    values = {k: list(dict.fromkeys(getattr(args, k))) for k in _SWEPT}
    varying = [k for k, v in values.items() if len(v) > 1] or ["router"]
    runs = []
    for combo in itertools.product(*values.values()):
        over = dict(zip(values, combo))
        label = "/".join(_label(k, over[k]) for k in varying)
        runs.append((label, over))
    return runs


def _label(key: str, value: Any) -> str:
    if key == "pd":
        return "aggregated" if value is None else f"{value[0]}P{value[1]}D"
    if key == "max_wait_ms":
        return "wait=none" if value is None else f"wait={value:g}ms"
    return str(value)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: --plot without matplotlib
        print(f"radixserve sim: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    cluster, cache, base_sched = _configs(args)
    runner = SimRunner(cluster.preset, seed=cluster.sim_seed)
    workload, requests = make_requests(args, runner.generate)
    if not requests:
        raise ValueError(f"nothing to simulate: the {args.workload} workload has no requests")
    chat = args.workload == "multi-turn"
    outputs = (lambda r: runner.generate(r.input_ids, r.output_len)) if chat else None
    best = ideal_prefix_hit_rate(requests, cache.page_size, outputs)
    print(_header(args.workload, workload, cluster, cache, requests, best))
    pd, slo = from_args(PDConfig, args), from_args(SloConfig, args)
    if any(args.pd):
        print(_pd_header(cluster, pd))
    if slo.set:
        print(f"goodput: requests meeting {slo.describe()}")
    block_tokens = workload.block_tokens if args.workload == "trace" else None
    results = []
    for label, over in _runs(args):
        sched = dataclasses.replace(
            base_sched,
            schedule_policy=over["schedule_policy"],
            max_wait_ms=over["max_wait_ms"],
        )
        config = dataclasses.replace(cluster, router=over["router"])
        evict = dataclasses.replace(cache, radix_eviction_policy=over["radix_eviction_policy"])
        split = over["pd"]
        if split is None:
            res = simulate(requests, config, sched, evict, label, args.progress, best, block_tokens)
        else:
            res = simulate_pd(requests, split, config, pd, sched, evict, label, block_tokens)
            res.best_hit_rate = best
        res.slo = slo
        if res.num_rejected:  # they left the hit rate, so they leave the best too
            res.best_hit_rate = ideal_prefix_hit_rate(
                _served(requests, res), cache.page_size, outputs
            )
        results.append(res)
    print(format_table(results))
    for r in results:
        if r.num_rejected:
            print(f"warning: {r.label}: {r.rejections()}; hit and best count the "
                  f"{r.num_requests - r.num_rejected} served requests only")  # fmt: skip
        if r.tiers:
            print(r.tier_lines())
        if block_tokens and r.block_hit_rate is not None:
            ideal = block_hit_rate(_served(requests, r))
            print(f"{r.label}: {r.block_hit_rate:.1%} of prompt blocks hit (best {ideal:.1%})")
    print(_speed(results))
    if args.json:
        doc_sched = dataclasses.asdict(base_sched)
        _write_json(args.json, args.workload, workload, cluster, cache, doc_sched, results)
    if args.plot:
        from radixserve.sim.plot import plot_results

        plot_results(results, args.plot, title=f"{args.workload}, {cluster.engines} engines")
        print(f"plot: {args.plot}")
    return 0 if all(r.num_unfinished == 0 == r.num_rejected for r in results) else 1


def _served(requests: list, res: SimResult) -> list:
    return [r for r in requests if r.rid not in res.rejected_rids]


def _header(
    name: str,
    workload: Any,
    cluster: ClusterConfig,
    cache: CacheConfig,
    requests: list,
    best: float,
) -> str:
    params = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(workload).items())
    prompt = sum(len(r.input_ids) for r in requests)
    return "\n".join(
        [
            f"workload: {name} ({params})",
            f"  {len(requests)} requests, {prompt:,} prompt tokens, "
            f"{sum(r.output_len for r in requests):,} output tokens",
            f"fleet: {cluster.engines} x {cluster.preset}, {cache.max_total_tokens:,} KV tokens "
            f"per engine, page size {cache.page_size}",
            *_tier_header(cluster, cache),
            f"best achievable hit rate (one unbounded cache): {best:.1%}",
        ]
    )


def _pd_header(cluster: ClusterConfig, pd: PDConfig) -> str:
    cost = get_cost_model(cluster.preset)
    bw = pd.transfer_bandwidth_gbs or cost.tier_spec().transfer_bandwidth / 1e9
    per_token = cost.kv_bytes_per_token_per_gpu / 1e3
    return (f"prefill/decode apart: prefill engines picked by {cluster.router}, decode engines "
            f"by {pd.decode_router}; KV sent at {bw:g} GB/s per GPU ({per_token:g} kB a token "
            f"per GPU)")  # fmt: skip


def _tier_header(cluster: ClusterConfig, cache: CacheConfig) -> list[str]:
    """The lower tiers as configured (nothing when there are none)."""
    cost = get_cost_model(cluster.preset)
    spec, lines = cluster.tiers.spec(cost), []
    host = host_tier_tokens(cost, cache)
    if host:
        lines.append(
            f"host tier: {host:,} KV tokens per engine, copies at {spec.host_bandwidth / 1e9:g} GB/s"
            f"; load/prefill ratio {cost.host_load_to_prefill_ratio(spec):.3f}"
        )
    store = cluster.tiers.store_tokens(cost)
    if store:
        ratio = cost.load_to_prefill_ratio(spec)
        lines.append(
            f"KV store: {store:,} tokens ({cluster.tiers.kv_store_gb:g} GB) for the fleet, "
            f"{spec.store_bandwidth / 1e9:g} GB/s and {spec.store_latency_s * 1e3:g} ms a get "
            f"per engine; load/prefill ratio {ratio:.2f}"
        )
    return lines


def _speed(results: list[SimResult]) -> str:
    reqs = sum(r.num_requests for r in results)
    wall = sum(r.wall_s for r in results)
    rate = 60 * reqs / wall if wall else float("inf")
    return f"simulated {reqs:,} requests in {wall:.1f} s of wall time: {rate:,.0f} requests/min"


def _write_json(
    path: str,
    name: str,
    workload: Any,
    cluster: ClusterConfig,
    cache: CacheConfig,
    sched: dict[str, Any],
    results: list[SimResult],
) -> None:
    # the swept settings are per run (results[i].router, .schedule_policy): the top level lists
    # what ran, one value when every run had the same
    doc = {
        "workload": {"name": name, **dataclasses.asdict(workload)},
        "cluster": {**dataclasses.asdict(cluster), "router": _ran(r.router for r in results)},
        "scheduler": {**sched, "schedule_policy": _ran(r.schedule_policy for r in results)},
        "cache": dataclasses.asdict(cache),
        "results": [r.to_dict() for r in results],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(finite(doc), f, indent=2, default=str)
    print(f"json: {path}")


def _ran(values: Any) -> str | list[str]:
    seen = list(dict.fromkeys(values))
    return seen[0] if len(seen) == 1 else seen
