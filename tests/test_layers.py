"""DESIGN.md's layer rules as a test: the import-linter contracts in pyproject.toml hold (nothing
imports upward, the router never imports the engine side or the simulator, the pure parts never
import torch or I/O code, no import circles), and they are live: a violation breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

grimp = pytest.importorskip("grimp", reason="import-linter (the dev extra) is not installed")

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


CONTRACTS = [c["name"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]]  # fmt: skip


def broken_contracts(report: str) -> list[str]:
    """The contracts a lint-imports report says are broken (its lines wrap long names)."""
    text = " ".join(report.split())
    return [n for n in CONTRACTS if f"{n} BROKEN" in text]


def lint_imports(src: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the package under `src`, with `config`'s contracts."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]
    return subprocess.run(
        [*cmd, "--config", str(config), "--no-cache"],
        capture_output=True, text=True, env=env, cwd=src.parent, timeout=300,
    )  # fmt: skip


def test_the_layer_contracts_hold() -> None:
    out = lint_imports(SRC, ROOT / "pyproject.toml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("router/policies/tree.py", "import asyncio", "do no I/O"),
        ("cache/radix.py", "import torch", "do no I/O"),
        ("router/proxy/config.py", "import radixserve.sim.cluster", "never imports the engine"),
        ("router/kvindex/block_index.py", "import radixserve.router.policies.base", "wings"),
        ("sched/request.py", "import radixserve.engine", "nothing imports upward"),
        ("router/proxy/metrics.py", "import radixserve.router.proxy.app", "no import circles"),
    ],
)
def test_a_violation_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str):
    src = tmp_path / "src"
    shutil.copytree(SRC / "radixserve", src / "radixserve", ignore=shutil.ignore_patterns("*.pyc"))
    with open(src / "radixserve" / module, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    out = lint_imports(src, ROOT / "pyproject.toml")
    assert out.returncode != 0, out.stdout
    assert any(contract in n for n in broken_contracts(out.stdout)), out.stdout


def test_no_module_is_part_of_an_import_circle() -> None:
    # Stronger than the sibling contract: any circle of module imports, whatever the packages
    # (imports made only for type checking included).
    graph = grimp.build_graph("radixserve")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's strongly connected components, iteratively
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    members.append(m)
                    if m == node:
                        break
                if len(members) > 1:
                    circles.append(sorted(members))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    assert circles == [], circles
