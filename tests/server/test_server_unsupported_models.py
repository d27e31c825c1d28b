"""`radixserve serve --model DIR` on a checkpoint this engine cannot run: one line on stderr
naming what is missing, exit status 1, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import build_tiny_model  # noqa: E402

# what is changed in a working qwen3_moe config.json -> what the one line must name
BROKEN = {
    "sliding-window": (
        {"use_sliding_window": True, "sliding_window": 64},
        "sliding-window attention (qwen3_moe) is not supported",
    ),
    "sliding-layer-types": (
        {"layer_types": ["sliding_attention", "full_attention"]},
        "sliding-window attention (qwen3_moe) is not supported",
    ),
    "yarn-rope": (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
        "unsupported rope type 'yarn'",
    ),
    "unknown-model-type": ({"model_type": "qwen3_next"}, "unsupported model_type 'qwen3_next'"),
    "no-experts": ({"num_local_experts": None}, "qwen3_moe config lacks num_experts"),
}


@pytest.fixture(scope="module")
def working(tmp_path_factory):
    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_an_unsupported_config_is_one_line_naming_it(working, tmp_path, case):
    change, expected = BROKEN[case]
    model = tmp_path / case
    shutil.copytree(working, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    _assert_refused_in_one_line(expected, "--model", str(model))


def test_experts_whose_columns_do_not_split_over_the_ranks_are_refused_in_one_line(
    working, tmp_path
):
    model = tmp_path / "odd-experts"
    shutil.copytree(working, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 33}))
    expected = ("--tp-size 2: the model has 33 expert MLP columns (moe_intermediate_size), "
                "not divisible by 2")  # fmt: skip
    _assert_refused_in_one_line(expected, "--model", str(model), "--tp-size", "2")


def _assert_refused_in_one_line(expected: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "radixserve", "serve", *args, "--port", "0",
           "--max-total-tokens", "4096"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("radixserve serve: ") and expected in lines[0], lines[0]
