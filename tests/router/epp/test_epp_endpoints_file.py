"""The EDS file `radixserve epp --endpoints-file` keeps for a standalone Envoy: what it lists,
that it is replaced whole, and the picker's flags refused in one line when out of range."""

from __future__ import annotations

import json
import subprocess
import sys

from radixserve.router.epp import endpoints_file


def _hosts(doc: dict) -> list[tuple[str, int]]:
    [resource] = doc["resources"]
    assert resource["@type"].endswith("envoy.config.endpoint.v3.ClusterLoadAssignment")
    assert resource["cluster_name"] == "inference_pool"  # the config's eds service_name
    [group] = resource["endpoints"]
    return [(e["endpoint"]["address"]["socket_address"]["address"],
             e["endpoint"]["address"]["socket_address"]["port_value"])
            for e in group["lb_endpoints"]]  # fmt: skip


def test_addresses_are_listed_and_names_left_out():
    doc = endpoints_file.assignment(["10.0.0.5:8000", "[fd00::7]:30000", "engine-0:30000"], 3)
    assert doc["version_info"] == "3"
    assert _hosts(doc) == [("10.0.0.5", 8000), ("fd00::7", 30000)]  # Envoy's EDS takes IPs only


def test_the_file_is_replaced_whole_and_readable(tmp_path):
    path = tmp_path / "pool.json"
    endpoints_file.write(path, ["127.0.0.1:1"], 1)
    endpoints_file.write(path, ["127.0.0.1:1", "127.0.0.1:2"], 2)
    assert _hosts(json.loads(path.read_text())) == [("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert [p.name for p in tmp_path.iterdir()] == ["pool.json"]  # no temporary left behind
    assert path.stat().st_mode & 0o044 == 0o044  # Envoy may run as another user


def test_a_negative_fallback_count_is_refused_in_one_line():
    cmd = [sys.executable, "-m", "radixserve", "epp", "--fallback-endpoints", "-1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "radixserve epp: --fallback-endpoints must be >= 0"
