"""`radixserve playground` (issue 18) as a process: its API equals `radixserve sim` for the same
settings, refuses bad settings with a 400 naming them, walks the 6-request trace through the real
scheduler; the browser tests (tests/playground/test_playground_browser.py) drive the page itself."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from urllib.parse import urlparse

import pytest

from radixserve.config import SchedulerConfig
from test_router_fleet import Proc  # noqa: E402

SETTINGS = {
    "shared_prob": 0.7,
    "num_prefixes": 6,
    "system_prompt_len": 192,
    "question_len": 24,
    "output_len": 6,
    "request_rate": 120.0,
    "num_requests": 90,
    "kv_tokens": 1000,
    "max_running_requests": 6,
    "max_wait_ms": 50.0,
    "policies": ["fcfs", "lpm", "dfs-weight"],
    "seed": 3,
}


class Playground(Proc):
    """`python -m radixserve playground --port 0 [flags]`; its address from its start-up line."""

    def __init__(self, *flags: str) -> None:
        super().__init__([sys.executable, "-m", "radixserve", "playground", "--port", "0", *flags])
        self.url = self.wait_line(r"radixserve playground: (http://\S+)").group(1)

    def call(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        addr = urlparse(self.url).netloc
        conn = http.client.HTTPConnection(addr, timeout=60)
        raw = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, raw)
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
        conn.close()
        return status, data


@pytest.fixture(scope="module")
def playground():
    pg = Playground()
    yield pg
    pg.stop()


def sim_cli(settings: dict, tmp_path) -> dict:
    """The same run by `radixserve sim`, read back from its --json."""
    out = tmp_path / "sim.json"
    flag = {"kv_tokens": "--max-total-tokens", "seed": "--workload-seed"}
    cmd = [sys.executable, "-m", "radixserve", "sim", "--workload", "shared-prefix-mix",
           "--engines", "1", "--router", "round_robin", "--no-progress", "--json", str(out)]  # fmt: skip
    for key, value in settings.items():
        name = flag.get(key, "--" + key.replace("_", "-"))
        if key == "policies":
            cmd += ["--schedule-policy", *value]
        else:
            cmd += [name, "none" if value is None else str(value)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def test_compare_equals_radixserve_sim(playground, tmp_path):
    status, body = playground.call("POST", "/api/compare", SETTINGS)
    assert status == 200, body
    page = {r["policy"]: r for r in json.loads(body)["results"]}
    cli = {r["label"]: r for r in sim_cli(SETTINGS, tmp_path)["results"]}
    assert list(page) == SETTINGS["policies"] == list(cli)
    for policy, r in cli.items():
        assert page[policy]["hit_rate"] == r["hit_rate"]
        assert page[policy]["wait_mean_s"] == r["wait_s"]["mean"]
        assert page[policy]["wait_p99_s"] == r["wait_s"]["p99"]
        assert page[policy]["finished"] == r["num_finished"] == SETTINGS["num_requests"]
    # the cache-aware orders reuse more than arrival order on this stream
    assert page["lpm"]["hit_rate"] > page["fcfs"]["hit_rate"]


def test_unbounded_wait_equals_sim_none(playground, tmp_path):
    settings = {**SETTINGS, "max_wait_ms": None, "policies": ["lpm"]}
    page = json.loads(playground.call("POST", "/api/compare", settings)[1])["results"][0]
    cli = sim_cli(settings, tmp_path)["results"][0]
    assert (page["hit_rate"], page["wait_p99_s"]) == (cli["hit_rate"], cli["wait_s"]["p99"])
    # the bound changes this run, so the equality above says None reached both as "unbounded"
    bounded = {**settings, "max_wait_ms": SETTINGS["max_wait_ms"]}
    other = json.loads(playground.call("POST", "/api/compare", bounded)[1])["results"][0]
    assert (other["hit_rate"], other["wait_p99_s"]) != (page["hit_rate"], page["wait_p99_s"])


def ndjson(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def test_default_bound_is_the_servers(playground):
    """The page starts at the fairness bound `radixserve serve` starts with (it once started at
    100 ms against the server's 1,000 without saying why), and a request that sets none gets it."""
    server_default = SchedulerConfig().max_wait_ms
    assert server_default == 1000.0
    status, data = playground.call("GET", "/api/settings")
    assert status == 200
    assert json.loads(data)["settings"]["max_wait_ms"]["default"] == server_default
    unset = {k: v for k, v in SETTINGS.items() if k != "max_wait_ms"}
    explicit = {**unset, "max_wait_ms": server_default}
    answers = [playground.call("POST", "/api/compare", body) for body in (unset, explicit)]
    assert [status for status, _ in answers] == [200, 200]
    assert json.loads(answers[0][1]) == json.loads(answers[1][1])


def test_sweeps_stream_every_point(playground):
    status, data = playground.call("POST", "/api/curve", SETTINGS)
    lines = ndjson(data)
    assert status == 200 and [m["done"] for m in lines] == list(range(1, 11))
    points = [m["point"] for m in lines]
    assert {p["shared_prob"] for p in points} == {0.0, 0.25, 0.5, 0.75, 1.0}
    by = {(p["policy"], p["shared_prob"]): p["hit_rate"] for p in points}
    assert by["lpm", 0.0] < by["lpm", 1.0]  # more sharing, more hits
    # a curve point is a compare run at that probability
    one = {**SETTINGS, "shared_prob": 0.5, "policies": ["lpm"]}
    assert (
        json.loads(playground.call("POST", "/api/compare", one)[1])["results"][0]["hit_rate"]
        == by["lpm", 0.5]
    )
    status, data = playground.call("POST", "/api/tradeoff", SETTINGS)
    bounds = [m["point"]["max_wait_ms"] for m in ndjson(data)]
    assert status == 200 and bounds[0] == 0 and bounds[-1] is None


def test_trace_lpm_hits_more_than_fcfs(playground):
    status, body = playground.call("POST", "/api/trace", {"policies": ["fcfs", "lpm"]})
    assert status == 200
    walk = json.loads(body)["policies"]
    hits = {p: [r["rid"] for r in rows if r["cached_tokens"]] for p, rows in walk.items()}
    # FCFS admits A1 B1 A2 B2 together: only the last two find their prompt cached
    assert hits == {"fcfs": ["A3", "B3"], "lpm": ["A2", "B2", "A3", "B3"]}
    assert [r["rid"] for r in walk["fcfs"]] == ["A1", "B1", "A2", "B2", "A3", "B3"]
    end = {p: max(r["finish_s"] for r in rows) for p, rows in walk.items()}
    assert end["lpm"] < end["fcfs"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"num_requests": -5}, "num_requests"),
        ({"system_prompt_len": -1}, "system_prompt_len"),
        ({"request_rate": 1e9}, "request_rate"),
        ({"request_rate": 0}, "request_rate"),
        ({"shared_prob": 1.5}, "shared_prob"),
        ({"kv_tokens": 100}, "kv_tokens"),  # cannot hold one request
        ({"num_requests": 5000, "system_prompt_len": 16000, "kv_tokens": 99999}, "num_requests"),
        ({"policies": ["no-such"]}, "policies"),
        ({"policies": []}, "policies"),
        ({"num_prefixes": 2.5}, "num_prefixes"),
        ({"output_len": "8"}, "output_len"),
        ({"temperature": 1}, "temperature"),
        (b"{not json", "body"),
        ([1, 2], "body"),
    ],
)
def test_bad_settings_are_refused_by_name(playground, body, param):
    for path in ("/api/compare", "/api/curve", "/api/tradeoff", "/api/trace"):
        status, data = playground.call("POST", path, body)
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error"
        assert err["code"] == "bad_request"  # a string, as the server's and the router's
        assert param in err["message"] or param == "body"
    assert playground.call("POST", "/api/compare", {})[0] == 200  # still up


def test_fleet_without_router_is_a_404(playground):
    status, data = playground.call("GET", "/api/fleet")
    assert status == 404 and "--router-url" in json.loads(data)["error"]["message"]


def test_bad_router_url_is_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "radixserve", "playground", "--router-url", "localhost:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "--router-url" in done.stderr


def test_fleet_reads_kv_blocks_where_the_router_indexes_events():
    """A router with KV events (issue 12) adds a per-worker kv_index_blocks gauge, labelled by
    worker id; the fleet view shows it as what the worker holds."""
    from radixserve.playground.fleet import _row, parse_metrics

    text = "\n".join(
        [
            "# TYPE radixserve_router_tree_size_units gauge",
            'radixserve_router_tree_size_units{worker="http://127.0.0.1:9001"} 210',
            "# TYPE radixserve_router_kv_index_blocks gauge",
            'radixserve_router_kv_index_blocks{worker="w1"} 37',
            "radixserve_router_expected_hit_rate 0.5",
        ]
    )
    router = parse_metrics(text)
    worker = {"id": "w1", "url": "http://127.0.0.1:9001", "requests": 3, "load": 1}
    row = _row(worker, {"hit_rate": 0.25}, router)
    assert (row["kv_index_blocks"], row["tree_size_units"], row["hit_rate"]) == (37, 210, 0.25)
    assert router["radixserve_router_expected_hit_rate"] == {"": 0.5}


def test_port_in_use_is_one_line(playground):
    port = urlparse(playground.url).port
    done = subprocess.run(
        [sys.executable, "-m", "radixserve", "playground", "--port", str(port)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
