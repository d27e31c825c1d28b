"""The README stays true where a check can tell: its test command is the one CI runs, its links
and anchors resolve, and it lists exactly the `--sim` presets the code registers."""

from __future__ import annotations

import re
from pathlib import Path

from radixserve.sim.costmodel import COST_MODELS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's ids of a markdown file's headings (outside code blocks)."""
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#+ (.*)", line)):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_test_command_is_the_one_ci_runs():
    lines = (ROOT / ".ci/run").read_text().splitlines()
    ci = [line for line in lines if line.startswith("pip install") and "pytest" in line]
    assert len(ci) == 1
    assert ci[0] in README.read_text().splitlines()


def test_links_and_anchors_resolve():
    bad = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{doc.name}: {target} (no such heading)")
    assert bad == []


def test_sim_presets_listed_are_the_registered_ones():
    text = README.read_text()
    section = text[text.index("### Simulated GPUs") :]
    section = section[: section.index("\n### ")]
    listed = re.findall(r"^\| `([\w.-]+)` \|", section, re.M)
    assert sorted(listed) == sorted(COST_MODELS)
