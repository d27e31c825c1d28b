"""The router and `radixserve serve --sim` under clients nobody here wrote (issue 15, item 4).

1. slowhttptest (Debian's) in slowloris (-H, slow headers) and slow-body (-B) modes against the
   router and against a server directly, while a normal client keeps sending completions: the
   target must stay responsive to it throughout (every probe answered, none failed).
2. wrk sustained non-streaming load on the router in front of 3 `serve --sim` workers while one
   worker is killed (SIGKILL) and restarted on its port; a streaming client runs beside it. The
   claim: zero non-streaming client errors (wrk's non-2xx and socket errors), and the count of
   streams cut by the kill (each ends with an error event, then [DONE]).

    python benchmarks/hostile_clients.py [--seconds 20] [--connections 400]

Needs `apt-get install -y slowhttptest wrk`; says so in one line and exits 2 if they are missing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from _machine import machine_line

PROMPT = {"prompt": "The quick brown fox", "max_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], ready: str, port: int) -> subprocess.Popen:
    """A `python -m radixserve ...` child that listens on `port`; waits until `ready` shows."""
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # type: ignore[union-attr]
        if ready in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit(f"{' '.join(args[:2])} did not start")


def sim_server(port: int) -> subprocess.Popen:
    return launch(["serve", "--sim", "tiny-cpu", "--log-level", "warning"], "serving", port)


def router(urls: list[str], port: int) -> subprocess.Popen:
    args = ["route", "--worker-urls", *urls, "--health-check-interval-secs", "0.5",
            "--log-level", "info"]  # fmt: skip
    return launch(args, "routing on", port)


class Prober(threading.Thread):
    """A normal client: one completion every `every` seconds; records latency or failure."""

    def __init__(self, port: int, every: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.port, self.every, self.stop = port, every, threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                conn.request("POST", "/v1/completions", json.dumps(PROMPT))
                status = conn.getresponse().status
                conn.close()
                if status == 200:
                    self.latencies.append(time.monotonic() - t0)
                else:
                    self.failures.append(str(status))
            except OSError as exc:
                self.failures.append(type(exc).__name__)
            self.stop.wait(self.every)

    def summary(self) -> str:
        lat = sorted(self.latencies) or [float("nan")]
        return (f"normal client: {len(self.latencies)} answered, {len(self.failures)} failed, "
                f"p50 {lat[len(lat) // 2] * 1e3:.0f} ms, max {lat[-1] * 1e3:.0f} ms")  # fmt: skip


def slowhttptest(port: int, mode: str, seconds: int, conns: int) -> tuple[str, Prober]:
    prober = Prober(port)
    prober.start()
    flags = ["-H"] if mode == "slowloris" else ["-B", "-t", "POST", "-s", "65536"]
    path = "/health" if mode == "slowloris" else "/v1/completions"
    cmd = ["slowhttptest", *flags, "-c", str(conns), "-r", "200", "-i", "5", "-x", "24",
           "-p", "3", "-l", str(seconds), "-u", f"http://127.0.0.1:{port}{path}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    out = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", out)  # its terminal colours
    prober.stop.set()
    prober.join()
    states = re.findall(r"service available:\s+(\w+)", out)
    connected = [int(n) for n in re.findall(r"connected:\s+(\d+)", out)]
    closed = [int(n) for n in re.findall(r"closed:\s+(\d+)", out)]
    verdict = (f"slowhttptest: service available {'YES' if set(states) == {'YES'} else states}, "
               f"up to {max(connected, default=0)} slow connections open at once, "
               f"{max(closed, default=0)} closed by the target")  # fmt: skip
    return verdict, prober


def slow_clients(args: argparse.Namespace) -> None:
    print(f"== slowhttptest: {args.connections} connections for {args.seconds} s per run")
    sim_port = free_port()
    sim = sim_server(sim_port)
    front_port = free_port()
    front = router([f"http://127.0.0.1:{sim_port}"], front_port)
    try:
        for target, port in (("router", front_port), ("serve --sim", sim_port)):
            for mode in ("slowloris", "slow body"):
                verdict, prober = slowhttptest(port, mode, args.seconds, args.connections)
                print(f"{target:<12} {mode:<10} {verdict}; {prober.summary()}")
    finally:
        for p in (front, sim):
            p.kill()


class Streamer(threading.Thread):
    """Streaming completions back to back; counts those complete, cut (error event then
    [DONE]) and failed outright."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.stop = port, threading.Event()
        self.complete = self.cut = self.failed = 0
        self.why: list[str] = []

    def run(self) -> None:
        body = json.dumps({**PROMPT, "max_tokens": 256, "stream": True})
        while not self.stop.is_set():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request("POST", "/v1/completions", body)
                resp = conn.getresponse()
                text = resp.read().decode()
                conn.close()
            except (OSError, http.client.HTTPException) as exc:
                self.failed += 1
                self.why.append(type(exc).__name__)
                continue
            if resp.status != 200:
                self.failed += 1
                self.why.append(f"{resp.status} {text[:120]}")
            elif '"error"' in text and text.rstrip().endswith("data: [DONE]"):
                self.cut += 1
            elif '"error"' in text:
                self.failed += 1
                self.why.append(text[-120:])
            else:
                self.complete += 1


def wrk_with_a_kill(args: argparse.Namespace) -> None:
    ports = [free_port() for _ in range(3)]
    sims = [sim_server(p) for p in ports]
    front_port = free_port()
    front = router([f"http://127.0.0.1:{p}" for p in ports], front_port)
    script = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False)
    body = json.dumps(PROMPT)
    script.write(f'wrk.method = "POST"\nwrk.body = \'{body}\'\n'
                 'wrk.headers["Content-Type"] = "application/json"\n')  # fmt: skip
    script.close()
    streamers = [Streamer(front_port) for _ in range(4)]
    for streamer in streamers:
        streamer.start()
    cmd = ["wrk", "-t2", "-c32", f"-d{args.seconds}s", "--latency", "-s", script.name,
           f"http://127.0.0.1:{front_port}/v1/completions"]  # fmt: skip
    print(f"== wrk: {' '.join(cmd[:4])} (POST {json.dumps(PROMPT)}), 4 streaming clients beside")
    try:
        load = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        time.sleep(args.seconds / 4)
        sims[0].send_signal(signal.SIGKILL)
        sims[0].wait()
        print(f"killed worker :{ports[0]} at {args.seconds / 4:.0f} s")
        time.sleep(args.seconds / 4)
        sims[0] = sim_server(ports[0])
        print(f"restarted it at {args.seconds / 2:.0f} s")
        out, _ = load.communicate(timeout=args.seconds + 60)
    finally:
        for streamer in streamers:
            streamer.stop.set()
        for streamer in streamers:
            streamer.join(60)  # their last streams end before the fleet goes
        for p in (front, *sims):
            p.kill()
        os.unlink(script.name)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: (.*)", out)
    print(f"wrk: {total.group(1) if total else '?'} requests, "
          f"{rps.group(1) if rps else '?'} req/s, non-2xx {non2xx.group(1) if non2xx else 0}, "
          f"socket errors: {sock.group(1) if sock else 'none'}")  # fmt: skip
    complete, cut = sum(s.complete for s in streamers), sum(s.cut for s in streamers)
    failed, why = sum(s.failed for s in streamers), [w for s in streamers for w in s.why]
    print(f"streams: {complete} complete, {cut} cut by the kill (error event, then [DONE]), "
          f"{failed} failed otherwise" + (f": {why[:3]}" if why else ""))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=20, help="length of each run")
    ap.add_argument("--connections", type=int, default=400, help="slowhttptest connections")
    ap.add_argument("--only", choices=("slow", "wrk"), help="run one part only")
    args = ap.parse_args()
    missing = [t for t in ("slowhttptest", "wrk") if shutil.which(t) is None]
    if missing:
        print(f"needs {' and '.join(missing)}: apt-get install -y slowhttptest wrk")
        return 2
    print(machine_line())
    if args.only in (None, "slow"):
        slow_clients(args)
    if args.only in (None, "wrk"):
        wrk_with_a_kill(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
