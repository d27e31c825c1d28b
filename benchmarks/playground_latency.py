"""How long the playground makes a user wait at its default settings: each API view (median of
N), the whole page from load to every chart drawn in headless chromium (if installed), against
the baseline of getting the comparison from `radixserve sim` on the command line.

    python benchmarks/playground_latency.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _machine import machine_line
from radixserve.playground.params import Params

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def start() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "playground", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    return proc, re.search(r"(http://\S+)", line).group(1)  # type: ignore[union-attr]


def post(url: str, body: dict) -> float:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    t = time.perf_counter()
    with urllib.request.urlopen(req) as resp:
        resp.read()
    return time.perf_counter() - t


def cli_compare(p: Params) -> float:
    cmd = [sys.executable, "-m", "radixserve", "sim", "--workload", "shared-prefix-mix",
           "--engines", "1", "--router", "round_robin", "--no-progress",
           "--max-total-tokens", str(p.kv_tokens), "--max-running-requests",
           str(p.max_running_requests), "--max-wait-ms", str(p.max_wait_ms),
           "--schedule-policy", *p.policies]  # fmt: skip
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t


def page_load(url: str, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds from navigation to the first numbers (the comparison) and to every chart."""
    from playwright.sync_api import sync_playwright

    first, out = [], []
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            tempfile.mkdtemp(), executable_path=CHROMIUM, args=ARGS, headless=True
        )
        for _ in range(repeats):
            page = ctx.new_page()
            t = time.perf_counter()
            page.goto(url)
            page.wait_for_function("window.playground.last.compare", polling=10)
            first.append(time.perf_counter() - t)
            page.wait_for_function(
                "window.playground.done >= 1 && !document.body.dataset.busy", polling=10
            )
            out.append(time.perf_counter() - t)
            page.close()
        ctx.close()
    return first, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    p = Params()
    print(machine_line())
    print(
        f"workload: shared-prefix-mix, {p.num_requests} requests, p(shared)={p.shared_prob}, "
        f"{p.num_prefixes} prefixes x {p.system_prompt_len} tokens + {p.question_len}, "
        f"{p.output_len} out, {p.request_rate:g} req/s; 1 engine, KV {p.kv_tokens} tokens, "
        f"{p.max_running_requests} running, max_wait_ms={p.max_wait_ms}, "
        f"policies {', '.join(p.policies)} (the playground's defaults)"
    )
    proc, url = start()
    try:
        times = {}
        for view in ("compare", "trace", "curve", "tradeoff"):
            times[view] = [post(f"{url}api/{view}", {}) for _ in range(args.repeats)]
        if Path(CHROMIUM).exists():
            first, drawn = page_load(url, args.repeats)
            times["page: first numbers"], times["page: every chart"] = first, drawn
    finally:
        proc.terminate()
        proc.wait()
    base = statistics.median(cli_compare(p) for _ in range(args.repeats))
    print(f"baseline: `radixserve sim` for the comparison alone, median {base:.2f} s")
    for view, ts in times.items():
        med = statistics.median(ts)
        print(f"{view:>24}: median {med:.2f} s over {len(ts)} ({med / base:.2f}x the baseline)")


if __name__ == "__main__":
    main()
