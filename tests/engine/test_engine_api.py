"""``from radixserve import Engine`` as users run it, each in a fresh interpreter: a script
without a ``__main__`` guard, code piped to ``python -``, a notebook cell (IPython's shell, as
Jupyter's kernel runs cells), and a platform that refuses to start child processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from tiny_models import build_tiny_model  # noqa: E402

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama3", tmp_path_factory.mktemp("tiny-api"))


def _code(model_dir) -> str:
    # no `if __name__ == "__main__":` guard, on purpose: users leave it out
    return f"""
import json
from radixserve import Engine
engine = Engine(model={str(model_dir)!r}, max_total_tokens=2048, context_length=128)
out = engine.generate("a radix tree", {{"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
engine.shutdown()
print("RESULT " + json.dumps(out))
"""


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0][len("RESULT ") :])


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          timeout=TIMEOUT_S)  # fmt: skip


def test_engine_from_a_script_without_a_main_guard(model_dir, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(_code(model_dir))
    out = _result(_run([str(script)]))
    assert out["meta_info"]["completion_tokens"] == 4 and len(out["output_ids"]) == 4


def test_engine_from_stdin_gives_the_scripts_tokens(model_dir, tmp_path):
    script = tmp_path / "same.py"
    script.write_text(_code(model_dir))
    piped = _result(_run(["-"], stdin=_code(model_dir)))
    assert piped["output_ids"] == _result(_run([str(script)]))["output_ids"]


def test_engine_from_a_notebook_cell(model_dir):
    pytest.importorskip("IPython")
    # a notebook kernel runs each cell with IPython's shell, inside its running event loop
    cell = _code(model_dir)
    driver = f"""
import asyncio
from IPython.core.interactiveshell import InteractiveShell
async def kernel():
    result = InteractiveShell.instance().run_cell({cell!r})
    result.raise_error()
asyncio.run(kernel())
"""
    out = _result(_run(["-c", driver]))
    assert out["meta_info"]["completion_tokens"] == 4


def test_engine_fails_in_one_sentence_where_processes_cannot_start(model_dir):
    # what a sandbox without fork/exec does: the system call fails with EAGAIN
    code = f"""
import errno, os, _posixsubprocess
def refuse(*args, **kwargs):
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
_posixsubprocess.fork_exec = refuse
from radixserve import Engine
try:
    Engine(model={str(model_dir)!r}, max_total_tokens=2048, context_length=128)
except Exception as e:
    print("ERROR " + type(e).__name__ + ": " + str(e))
"""
    proc = _run(["-"], stdin=code)
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR ")]
    assert proc.returncode == 0 and len(errors) == 1, proc.stdout + proc.stderr
    assert errors[0].startswith("ERROR EngineStartError: radixserve cannot start its engine's "
                                "child processes on this platform")  # fmt: skip
    assert "Traceback" not in proc.stderr


def test_package_import_stays_light():
    code = "import sys, radixserve; print(sorted(m for m in sys.modules if m.startswith(("
    code += "'torch', 'radixserve.engine', 'zmq'))))"
    assert _run(["-c", code]).stdout.strip() == "[]"
