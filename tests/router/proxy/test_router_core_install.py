"""The router on the core install, where the redis extra is absent (issue 25): every policy
starts and serves, and only `--kv-index redis://...` (or `kv-indexer`) asks for the extra, in
one line, before anything starts. redis-py is made unimportable in the child process itself."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys

import pytest

pytest.importorskip("httptools")

from radixserve.router.policies.registry import POLICIES  # noqa: E402
from test_router_fleet import FAKE, Proc  # noqa: E402

# `python -c NO_REDIS ARGS...` runs `radixserve ARGS...` with `import redis` failing
NO_REDIS = ("import sys; sys.modules['redis'] = None; from radixserve.cli import main; "
            "sys.exit(main(sys.argv[1:]))")  # fmt: skip
HINT = "pip install 'radixserve[redis]'"


def no_redis(*args: str) -> list[str]:
    return [sys.executable, "-c", NO_REDIS, *args]


@pytest.fixture(scope="module")
def worker_url():
    worker = Proc([sys.executable, str(FAKE), "--port", "0"])
    port = worker.wait_line(r"READY (\d+)").group(1)
    yield f"http://127.0.0.1:{port}"
    worker.stop()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_starts_and_serves_without_redis(worker_url, policy):
    router = Proc(no_redis("route", "--port", "0", "--log-level", "info", "--policy", policy,
                           "--worker-urls", worker_url))  # fmt: skip
    try:
        addr = router.wait_line(r"routing on http://(\S+) to").group(1)
        conn = http.client.HTTPConnection(addr, timeout=30)
        payload = {"text": "hello there", "sampling_params": {"max_new_tokens": 4}}
        conn.request("POST", "/generate", json.dumps(payload))
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["text"]
        conn.close()
    finally:
        router.stop()
    assert not any("Traceback" in line for line in router.lines), "".join(router.lines)


@pytest.mark.parametrize(
    "args",
    [
        ("route", "--policy", "kv_aware", "--kv-index", "redis://127.0.0.1:1/0",
         "--worker-urls", "http://127.0.0.1:1"),
        ("kv-indexer", "--redis", "redis://127.0.0.1:1/0", "--worker-urls", "http://127.0.0.1:1"),
    ],
)  # fmt: skip
def test_redis_without_the_extra_is_one_line_and_status_2(args):
    done = subprocess.run(no_redis(*args), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert HINT in done.stderr and done.stderr.startswith(f"radixserve {args[0]}: ")


def test_help_works_without_redis():
    done = subprocess.run(no_redis("--help"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "route" in done.stdout, done.stderr
