"""The README's "Prefill and decode apart" commands as a user runs them: its two `radixserve
serve` lines, its `radixserve route --pd-disaggregation` line and its curl, read out of
README.md and run as written (only the ports changed to free ones), printing what the README
shows; afterwards neither engine holds a KV slot."""

from __future__ import annotations

import re
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("mooncake.engine")
pytest.importorskip("torch")

from tests.router.proxy.test_router_pd import PdRouter, free_port  # noqa: E402
from tests.server.test_readme_quickstart import assert_elided_match, shown  # noqa: E402
from tests.server.test_server_pd import START_S, _settled  # noqa: E402
from tests.server_harness import ServerProcess  # noqa: E402

README = Path(__file__).resolve().parents[3] / "README.md"
PORTS = {"prefill": "30010", "decode": "30020", "router": "30000", "bootstrap": "8998"}


def pd_block() -> str:
    """The section's first bash block: the commands that start 1P1D and query it."""
    text = README.read_text()
    section = text[text.index("\n### Prefill and decode apart\n") + 1 :]
    section = section[: section.index("\n### ")]
    return re.search(r"^```bash\n(.*?)^```$", section, re.S | re.M).group(1)


def command(prefix: str) -> list[str]:
    lines = [ln for ln in pd_block().splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, f"the README's PD block has {len(lines)} lines starting {prefix!r}"
    return shlex.split(lines[0])[2:]


@pytest.fixture(scope="module")
def fleet():
    boot = str(free_port())
    serves = [command("radixserve serve --port " + PORTS[r]) for r in ("prefill", "decode")]
    # ServerProcess passes --port 0 itself; the README's ports are dropped, its bootstrap port
    # replaced by a free one
    args = [[boot if a == PORTS["bootstrap"] else a for a in s[2:]] for s in serves]
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(lambda a: ServerProcess(a, START_S), args)
    route = " ".join(command("radixserve route"))
    route = route.replace(f":{PORTS['prefill']} {PORTS['bootstrap']}", f":{prefill.port} {boot}")
    route = route.replace(f":{PORTS['prefill']}", f":{prefill.port}")
    route = route.replace(f":{PORTS['decode']}", f":{decode.port}")
    flags = shlex.split(route)
    assert flags[:2] == ["--port", PORTS["router"]] and flags[2] == "--pd-disaggregation"
    router = PdRouter(*flags[3:])
    yield prefill, decode, router
    router.stop()
    for proc in (prefill, decode):
        proc.stop()


def test_the_readme_commands_start_1p1d_and_its_curl_prints_what_it_shows(fleet):
    prefill, decode, router = fleet
    block = pd_block()
    curl = block[block.index("curl -s") :]
    lines = curl.rstrip("\n").splitlines()
    code = "\n".join(ln for ln in lines if not ln.startswith("#"))
    port = router.addr.rsplit(":", 1)[1]
    code = code.replace(f"localhost:{PORTS['router']}", f"localhost:{port}")
    done = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert_elided_match(shown(curl), done.stdout.strip())
    for engine in (prefill, decode):
        _settled(engine)
