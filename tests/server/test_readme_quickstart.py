"""The README's quick start as a new user meets it: its `radixserve serve` command on the built-in
model from an empty weights cache (so the GGUF is converted and the kernels built), then its curl
and Python examples, read out of README.md and run as written (only the port changed), printing
what the README shows under them; then, on the same server, the structured-output curls of
"Sampling, log probabilities, structured output"."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("openai")

from radixserve.modelfiles.locate import default_model_path  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
README_PORT = "30000"
FIRST_START_S = 600.0  # conversion and a kernel build on a small, busy CPU
RUN_S = 120.0


def quick_start() -> str:
    text = README.read_text()
    section = text[text.index("\n## Quick start\n") + 1 :]
    return section[: section.index("\n## ")]


def sampling_section() -> str:
    text = README.read_text()
    section = text[text.index("\n### Sampling, log probabilities, structured output\n") + 1 :]
    return section[: section.index("\n### ")]


def curls(block: str) -> list[tuple[str, str]]:
    """(command, the ``# `` lines shown under it) for each ``curl`` command of ``block``; a
    command runs on to the first shown line."""
    out: list[tuple[str, str]] = []
    for piece in re.split(r"^(?=curl )", block, flags=re.M):
        if piece.startswith("curl "):
            lines = piece.rstrip("\n").splitlines()
            first = next(i for i, ln in enumerate(lines) if ln.startswith("#"))
            out.append(("\n".join(lines[:first]), "\n".join(lines[first:])))
    return out


def code_block(lang: str, marker: str) -> str:
    """The one fenced ``lang`` block of the README's quick start that contains ``marker``."""
    blocks = re.findall(rf"^```{lang}\n(.*?)^```$", quick_start(), re.S | re.M)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"the quick start has {len(found)} {lang} blocks with {marker!r}"
    return found[0]


def shown(block: str) -> str:
    """What the README shows a block printing: its ``# `` comment lines after the code, joined
    (a continuation line's indent is layout, not output)."""
    lines = block.rstrip("\n").splitlines()
    tail = []
    while lines and lines[-1].startswith("#"):
        tail.insert(0, lines.pop()[1:].strip())
    return "".join(tail)


def code(block: str, port: int) -> str:
    """The block's code without the output shown under it, on the server's port."""
    lines = block.rstrip("\n").splitlines()
    while lines and lines[-1].startswith("#"):
        lines.pop()
    return "\n".join(lines).replace(f":{README_PORT}", f":{port}") + "\n"


def assert_elided_match(expected: str, actual: str) -> None:
    """``actual`` is ``expected`` where the README elides parts of it with ``...``."""
    pattern = ".+?".join(re.escape(part) for part in expected.split("..."))
    assert re.fullmatch(pattern, actual, re.S), f"README shows:\n{expected}\nprinted:\n{actual}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The README's serve command (port 0 for its 30000), with a weights cache of its own."""
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    line = next(ln for ln in code_block("bash", "radixserve serve --port").splitlines()
                if ln.startswith("radixserve serve"))  # fmt: skip
    args = [("0" if a == README_PORT else a) for a in shlex.split(line)[2:]]
    cache = tmp_path_factory.mktemp("weights-cache")
    proc = ServerProcess([*args, "--weights-cache-dir", str(cache)], FIRST_START_S)
    yield proc
    proc.stop()


def run(args: list[str]) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=RUN_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def test_it_starts_with_the_line_the_readme_shows_and_lists_that_model(server):
    text = " ".join(quick_start().split())
    ready = re.search(r"ready when it prints `(radixserve: serving [^`]+)`", text).group(1)
    assert ready.replace(f":{README_PORT}", f":{server.port}") + "\n" in server.lines
    models = server.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [ready.split()[2]] == [server.name]


def test_the_curl_then_the_python_example_print_what_the_readme_shows(server):
    """The curl example on a fresh server prints the reply shown (nothing cached yet); the
    Python example, the same prompt again, prints the text and the cached count shown."""
    curl = code_block("bash", "curl -s localhost:")
    printed = run(["bash", "-c", code(curl, server.port)])
    assert_elided_match(shown(curl), printed)
    python = code_block("python", "from openai import OpenAI")
    expected, _, claim = shown(python).partition("<-")
    assert run([sys.executable, "-c", code(python, server.port)]) == expected.strip()
    cached, of = re.search(r"(\d+) of the same prompt's (\d+) tokens cached", claim).groups()
    usage = json.loads(printed)["usage"]
    assert (int(cached), int(of)) == (int(expected.split()[-1]), usage["prompt_tokens"])


def test_the_structured_output_curls_print_what_the_readme_shows(server):
    """A JSON schema on the chat route and a regex on /generate, both greedy, with logprobs."""
    block = re.findall(r"^```bash\n(.*?)^```$", sampling_section(), re.S | re.M)[0]
    examples = curls(block)
    assert len(examples) == 2, "the structured-output block has two curls"
    for command, output in examples:
        printed = run(["bash", "-c", code(command, server.port)])
        assert_elided_match(shown(output), printed)
