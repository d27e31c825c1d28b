"""`radixserve bench`: load an OpenAI-compatible or SGLang /generate endpoint with a workload
(the simulator's), at a fixed request rate or concurrency; print, save and plot the results."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from radixserve.bench.backends import BACKENDS
from radixserve.bench.loadgen import LoadConfig, run_load
from radixserve.bench.report import format_summary, plot_records, summarize
from radixserve.config import add_check, bounded, writable_file
from radixserve.sim.workload_args import add_workload_args, finite, make_requests, workload_config
from radixserve.sim.workloads import ideal_prefix_hit_rate


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `bench` subcommand."""
    parser = subparsers.add_parser(
        "bench",
        help="load generator for OpenAI-compatible and /generate endpoints",
        description=(
            "Send a workload's requests (prompts rendered as text, one word per token id) and "
            "stream the answers. Open loop at the workload's arrival times (--request-rate: "
            "Poisson; trace: its timestamps), or closed loop with --max-concurrency."
        ),
    )
    add_workload_args(parser)
    g = parser.add_argument_group("target")
    g.add_argument(
        "--base-url", default="http://127.0.0.1:30000", type=_url, help="server or router URL"
    )
    g.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="openai",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions; sglang: /generate",
    )
    g.add_argument("--model", default=None, help="model name sent to OpenAI endpoints")
    g.add_argument("--api-key", default=None, help="bearer token")
    g.add_argument(
        "--max-concurrency",
        type=bounded(int, ge=1),
        default=None,
        help="closed loop: keep this many requests in flight (default: open loop)",
    )
    g.add_argument(
        "--timeout-s", type=bounded(float, gt=0), default=600.0,
        help="longest one request may take",
    )  # fmt: skip
    out = parser.add_argument_group("output")
    out.add_argument(
        "--json", metavar="PATH", type=writable_file, help="write the summary and every request"
    )
    out.add_argument(
        "--plot", metavar="PNG", type=writable_file, help="latency CDFs (needs matplotlib)"
    )
    out.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar"
    )
    add_check(parser, _check)  # every setting is checked before the first request
    parser.set_defaults(run=run)
    return parser


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):  # else every request fails alike
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL, got {text!r}")
    return text


def _check(args: argparse.Namespace) -> None:
    workload_config(args)
    if args.plot:
        from radixserve.sim.plot import import_pyplot

        try:
            import_pyplot()
        except RuntimeError as e:  # --plot without matplotlib
            raise ValueError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"radixserve bench: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    _check(args)
    workload, requests = make_requests(args)
    best = ideal_prefix_hit_rate(requests)
    mode = (
        f"closed loop, {args.max_concurrency} in flight"
        if args.max_concurrency
        else "open loop at the workload's arrival times"
    )
    print(f"workload: {args.workload}, {len(requests)} requests; {mode}")
    print(f"target: {args.base_url}{BACKENDS[args.backend].path}")
    cfg = LoadConfig(
        base_url=args.base_url,
        backend=BACKENDS[args.backend](),
        model=args.model,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout_s,
        api_key=args.api_key,
        progress=args.progress,
    )
    records = asyncio.run(run_load(requests, cfg))
    summary = summarize(records)
    print(format_summary(summary, best))
    if args.json:
        doc = {
            "workload": {"name": args.workload, **dataclasses.asdict(workload)},
            "target": {"base_url": args.base_url, "backend": args.backend, "model": cfg.model},
            "max_concurrency": args.max_concurrency,
            "best_hit_rate": best,
            "summary": summary,
            "requests": [dataclasses.asdict(r) for r in records],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(finite(doc), f, indent=2, default=str)
        print(f"json: {args.json}")
    if args.plot:
        plot_records(records, args.plot, title=f"{args.workload} against {args.base_url}")
        print(f"plot: {args.plot}")
    return 0 if summary["failed"] == 0 else 1
