"""The simulator against a real run over HTTP, at small scale: the same workload through
`radixserve serve --sim` workers behind `radixserve route` (one run per policy, fresh workers
each time), driven by the bench load generator; then through the simulator with the same fleet.
The hit rates should agree within a few points; throughput is not compared (the real workers
run on this machine's shared cores, the simulator on the cost model's GPU time).

    python benchmarks/sim_vs_http.py [--engines 4] [--policies round_robin cache_aware]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import time
import urllib.request

from _machine import machine_line
from radixserve.bench.backends import OpenAICompletions
from radixserve.bench.loadgen import LoadConfig, run_load
from radixserve.bench.report import summarize
from radixserve.config import CacheConfig
from radixserve.sim.cluster import ClusterConfig, simulate
from radixserve.sim.workloads import (
    SharedPrefixConfig,
    generated_shared_prefix,
    ideal_prefix_hit_rate,
)

CLI = [sys.executable, "-m", "radixserve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(preset: str, kv_tokens: int) -> tuple[subprocess.Popen, str]:
    cmd = CLI + ["serve", "--sim", preset, "--port", "0", "--max-total-tokens", str(kv_tokens)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # type: ignore[union-attr]
        m = re.search(r"serving .* on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError(f"worker exited: {proc.wait()}")


def wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def http_hit_rate(policy: str, args: argparse.Namespace, reqs: list) -> tuple[float, int]:
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for _ in range(args.engines):
            proc, url = start_worker(args.preset, args.kv_tokens)
            procs.append(proc)
            urls.append(url)
        port = free_port()
        route = CLI + ["route", "--policy", policy, "--port", str(port), "--worker-urls", *urls]
        route += ["--health-check-interval-secs", "0", "--log-level", "warning"]
        procs.append(subprocess.Popen(route, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        cfg = LoadConfig(base, OpenAICompletions(), max_concurrency=args.concurrency)
        cfg.progress = False
        summary = summarize(asyncio.run(run_load(reqs, cfg)))
        if summary["cache_hit_rate"] is None:
            raise RuntimeError("the workers reported no cached tokens")
        return summary["cache_hit_rate"], summary["failed"]
    finally:
        stop(procs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--kv-tokens", type=int, default=20000, help="KV pool of every worker")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    args = ap.parse_args()
    wl = SharedPrefixConfig(
        num_groups=8, prompts_per_group=16, system_prompt_len=1024, question_len=64, output_len=16
    )
    reqs = generated_shared_prefix(wl)
    print(machine_line())
    print(
        f"workload: {wl.num_groups} groups x {wl.prompts_per_group} prompts, "
        f"{wl.system_prompt_len}-token system prompt, {wl.question_len}-token question, "
        f"{wl.output_len} output tokens; {args.concurrency} in flight; {args.engines} x "
        f"{args.preset} workers, {args.kv_tokens:,} KV tokens each"
    )
    print(f"best achievable hit rate: {ideal_prefix_hit_rate(reqs):.1%}")
    print(f"{'policy':<12} {'simulated':>9} {'over HTTP':>9} {'diff':>7}")
    worst = 0.0
    for policy in args.policies:
        sim = simulate(
            reqs,
            ClusterConfig(args.engines, policy, args.preset, max_concurrency=args.concurrency),
            cache_config=CacheConfig(max_total_tokens=args.kv_tokens),
        )
        real, failed = http_hit_rate(policy, args, reqs)
        diff = 100 * (real - sim.hit_rate)
        worst = max(worst, abs(diff))
        note = f"  ({failed} failed)" if failed else ""
        print(f"{policy:<12} {sim.hit_rate:9.1%} {real:9.1%} {diff:+6.1f}p{note}")
    print(f"largest difference: {worst:.1f} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
