"""Every bad `serve` / `sim` / `bench` / `playground` / `route` / `kv-indexer` value is refused
while the flags are parsed: one line naming the flag and a hint, exit status 2, no traceback,
and nothing started (no engine, no simulation, no request, no listening socket)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.cli import main

NOWHERE = "/nonexistent-dir-of-radixserve-tests"

SERVE = [
    (["--model", f"{NOWHERE}/model"], "--model"),
    (["--model", "/etc/hostname"], "--model"),
    (["--max-wait-ms", "-5"], "--max-wait-ms must be >= 0 (got -5)"),
    (["--max-wait-ms", "nan"], "--max-wait-ms must be a number"),
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1"),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be >= 1"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be >= 1 or -1"),
    (["--num-threads", "-2"], "--num-threads must be >= 0"),
    (["--context-length", "-1"], "--context-length must be >= 1"),
    (["--new-token-ratio", "5"], "--new-token-ratio must be <= 1"),
    (["--min-new-token-ratio", "0.9"], "min_new_token_ratio (0.9) must be <= new_token_ratio"),
    (["--new-token-ratio-decay", "-0.1"], "--new-token-ratio-decay must be >= 0"),
    (["--priority-preemption-threshold", "-1"], "--priority-preemption-threshold must be >= 0"),
    (["--in-batch-prefix-threshold", "-1"], "--in-batch-prefix-threshold must be >= 0"),
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--max-total-tokens", "0"], "--max-total-tokens must be >= 1"),
    (["--page-size", "16", "--chunked-prefill-size", "8"], "chunked_prefill_size must be -1"),
    (["--sampling-seed", str(2**64)], "--sampling-seed must be < 18446744073709551616"),
    (["--device", "nonsense"], "--device is not a torch device"),
    (["--weights-cache-dir", "/etc/hostname/cache"], "--weights-cache-dir"),
    (["--port", "70000"], "--port must be <= 65535"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    (["--health-generate-timeout-secs", "0"], "--health-generate-timeout-secs must be > 0"),
    (["--graceful-shutdown-secs", "-1"], "--graceful-shutdown-secs must be >= 0"),
    (["--schedule-policy", "bogus"], "--schedule-policy: invalid choice: 'bogus'"),
    (["--max-wait-ms", "soon"], "--max-wait-ms: invalid float value: 'soon'"),
    (["--sim", "no-such-gpu"], "unknown cost model 'no-such-gpu'"),
    (["--kv-events-config", "{"], "--kv-events-config: not valid JSON"),
    (["--cpu-kernels", "off", "--attention-backend", "cpu-paged"], "cpu-paged runs radixserve's"),
    (["--cpu-kernels", "fast"], "--cpu-kernels: invalid choice: 'fast'"),
]
SIM = [
    (["--engines", "0"], "--engines must be >= 1"),
    (["--json", f"{NOWHERE}/out.json"], "--json: no directory"),
    (["--plot", f"{NOWHERE}/out.png"], "--plot: no directory"),
    (["--json", "/"], "--json: / is a directory"),
    (["--max-wait-ms", "10", "none", "-3"], "--max-wait-ms must be >= 0 (got -3)"),
    (["--router", "bogus"], "--router: invalid choice"),
    (["--workload", "trace"], "--workload trace needs --trace PATH"),
    (["--workload", "trace", "--trace", f"{NOWHERE}/t.jsonl"], "no such file"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--vocab-size", "2"], "--vocab-size must be >= 3"),
    (["--cache-threshold", "2"], "cache_threshold must be within [0, 1]"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--num-sessions", "3"], "has no parameter --num-sessions"),
]
BENCH = [
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--timeout-s", "0"], "--timeout-s must be > 0"),
    (["--base-url", "127.0.0.1:8000"], "--base-url must be an http:// or https:// URL"),
    (["--json", f"{NOWHERE}/b.json"], "--json: no directory"),
    (["--output-len", "0"], "output_len"),
]
PLAYGROUND = [
    (["--port", "-1"], "--port must be >= 0"),
    (["--router-url", "localhost:1"], "--router-url must be http(s)://host:port"),
    (["--log-level", "loud"], "--log-level: invalid choice"),
]
OTHERS = [  # route and kv-indexer through the same parser and config machinery
    (["route", "--policy", "nope"], "--policy: invalid choice"),
    (["route", "--port", "0", "--max-url-size", "0"], "--max-url-size must be >= 1 (got 0)"),
    (["route", "--port", "70000"], "--port must be <= 65535 (got 70000)"),
    (["route", "--health-check-interval-secs", "-1"], "--health-check-interval-secs must be >= 0"),
    (["route", "--overload-kv-usage-threshold", "3"], "--overload-kv-usage-threshold must be <= 1"),
    (["route", "--max-retries", "-1"], "--max-retries must be >= 0 (got -1)"),
    (
        ["route", "--retry-backoff-ms", "50", "--retry-max-backoff-ms", "10"],
        "retry_max_backoff_ms must be >= retry_backoff_ms",
    ),
    (
        ["route", "--policy", "kv_aware", "--kv-index", "redis://x", "--kvs-timeout-ms", "0"],
        "--kvs-timeout-ms must be > 0",
    ),
    (["kv-indexer", "--redis", "http://x"], "--redis must be a redis:// URL"),
]
CASES = (
    [(["serve", *flags], want) for flags, want in SERVE]
    + [(["sim", "--no-progress", *flags], want) for flags, want in SIM]
    + [(["bench", "--no-progress", *flags], want) for flags, want in BENCH]
    + [(["playground", *flags], want) for flags, want in PLAYGROUND]
    + OTHERS
)


# the values the issue found, a wrong choice, and one per other subcommand, also as a real
# process: exit status 2 and no traceback
AS_A_PROCESS = [CASES[i] for i in range(10)] + [
    case
    for case in CASES
    if case[0][-1] in ("bogus", "localhost:1", "nope", "http://x")
    or case[0][-2:] in (["--plot", f"{NOWHERE}/out.png"], ["--timeout-s", "0"])
]


def _one_line(command: str, out: str, err: str, want: str) -> None:
    assert out == "", out  # nothing ran: no "starting the engine", no workload line
    (line,) = err.splitlines()
    assert line.startswith(f"radixserve {command}: error: ") and want in line, line
    assert line.endswith(f"; see radixserve {command} --help")


@pytest.mark.parametrize(("argv", "want"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_value_is_one_line_before_anything_starts(
    argv: list[str], want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    _one_line(argv[0], captured.out, captured.err, want)


@pytest.mark.parametrize(("argv", "want"), AS_A_PROCESS, ids=[" ".join(a) for a, _ in AS_A_PROCESS])
def test_a_bad_value_ends_the_process_with_status_2(argv: list[str], want: str) -> None:
    cmd = [sys.executable, "-m", "radixserve", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    _one_line(argv[0], done.stdout, done.stderr, want)


def test_a_wrong_choice_is_one_line_not_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--radix-eviction-policy", "newest"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert (
        "usage:" not in captured.err and "--radix-eviction-policy: invalid choice" in captured.err
    )


def test_the_cuda_device_is_refused_where_torch_has_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["serve", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device has no usable cuda device here" in err


def test_an_output_path_is_not_left_behind_by_the_check(tmp_path: Path) -> None:
    """--json is tried for writing while parsing; a file that did not exist is removed again
    (here the run then fails on a later flag, so nothing else writes it)."""
    out = tmp_path / "out.json"
    assert main(["sim", "--json", str(out), "--engines", "0"]) == 2
    assert not out.exists()


def test_good_values_still_parse() -> None:
    from radixserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-wait-ms", "inf", "--chunked-prefill-size",
                                      "-1", "--new-token-ratio", "1", "--port", "0"])  # fmt: skip
    assert args.max_wait_ms == float("inf") and args.chunked_prefill_size == -1
