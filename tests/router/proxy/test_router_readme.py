"""The README's router walk-through as a user runs it: its three `serve --sim` workers and its
`radixserve route` line, then every curl of the section's two blocks, read out of README.md and
run in order as written (only the ports changed to free ones), each printing what the README
shows under it, with the status shown beside it."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httptools")

from test_router_fleet import Proc  # noqa: E402

README = Path(__file__).resolve().parents[3] / "README.md"
WORKER_PORTS = ("31101", "31102", "31103")
ROUTER_PORT = "31180"
READY = r"serving \S+ on http://127\.0\.0\.1:(\d+)"


def blocks() -> list[str]:
    """The section's first two bash blocks: the fleet and its first request, then the admin API."""
    text = README.read_text()
    section = text[text.index("\n### The router: workers, admin API, metrics\n") + 1 :]
    section = section[: section.index("\n### ")]
    found = re.findall(r"^```bash\n(.*?)^```$", section, re.S | re.M)
    assert len(found) >= 2, "the router section lost its two example blocks"
    return found[:2]


def examples(block: str) -> list[tuple[str, str]]:
    """(command, what the README shows it printing) for every curl line of ``block``."""
    out, lines = [], block.rstrip("\n").splitlines()
    for i, line in enumerate(lines):
        if line.startswith("curl "):
            shown = []
            for nxt in lines[i + 1 :]:
                if not nxt.startswith("#"):
                    break
                shown.append(nxt[1:].strip())
            out.append((line, "\n".join(shown)))
    return out


def matches(shown: str, printed: str) -> bool:
    """``printed`` is ``shown`` where the README elides with ``...`` and wraps a line (a space
    at a wrap is the output's own, or none)."""
    lines = [".+?".join(re.escape(p) for p in ln.split("...")) for ln in shown.splitlines()]
    return re.fullmatch(" ?".join(lines), printed, re.S) is not None


@pytest.fixture(scope="module")
def fleet():
    """The README's workers and router, on free ports; {README port: actual port}."""
    first = blocks()[0]
    serve = re.search(r"do (radixserve serve .*?) & done", first).group(1)
    args = [a for a in shlex.split(serve)[2:]]
    args[args.index("$p")] = "0"
    procs, ports = [], {}
    try:
        for readme_port in WORKER_PORTS:
            worker = Proc([sys.executable, "-m", "radixserve", "serve", *args])
            procs.append(worker)
            ports[readme_port] = worker.wait_line(READY).group(1)
        route = next(ln for ln in first.splitlines() if ln.startswith("radixserve route"))
        route = route.rstrip(" &").replace(f"--port {ROUTER_PORT}", "--port 0")
        for readme_port, port in ports.items():
            route = route.replace(f":{readme_port}", f":{port}")
        router = Proc([sys.executable, "-m", *shlex.split(route)])
        procs.append(router)
        ports[ROUTER_PORT] = router.wait_line(r"routing on http://127\.0\.0\.1:(\d+) to").group(1)
        for worker in ("w1", "w2"):
            router.wait_line(rf"{worker} .* recognised as a radixserve worker")
        yield ports
    finally:
        for proc in procs:
            proc.stop()


def on_ports(text: str, ports: dict[str, str]) -> str:
    for readme_port, port in ports.items():
        text = text.replace(f":{readme_port}", f":{port}")
    return text


def run(command: str, ports: dict[str, str]) -> tuple[str, str]:
    """The command's output and HTTP status, with ``R`` set as the README sets it."""
    command = command.split("  #")[0]  # a comment after the command
    script = f"R=http://127.0.0.1:{ports[ROUTER_PORT]}\n{on_ports(command, ports)} -w '\\n%{{http_code}}'"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    body, _, status = done.stdout.rpartition("\n")
    return body, status


def test_every_curl_of_the_router_walkthrough_prints_what_the_readme_shows(fleet):
    first, admin = blocks()
    for command, shown in [*examples(first), *examples(admin)]:
        if command.endswith("# twice"):  # the second answer is the one shown: cached tokens
            run(command, fleet)
        printed, status = run(command, fleet)
        shown = on_ports(shown, fleet)
        want = re.search(r"\s+\((\d{3})\)$", shown)
        if want is not None:
            shown = shown[: want.start()]
        assert matches(shown, printed), f"{command}\nREADME shows:\n{shown}\nprinted:\n{printed}"
        assert status == (want.group(1) if want else "200"), f"{command}: {status}\n{printed}"
