"""`radixserve kv-store --start-master`: a ready line with every address, pages written through
it readable, and SIGTERM leaves no Mooncake process behind; bad flags are a one-line error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from mooncake_harness import backend_ports, pin_this_process, require_mooncake
from radixserve.kvstore.backends import create_backend
from radixserve.kvstore.mooncake_procs import segments
from radixserve.kvstore.storage import PageFormat


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def test_kv_store_serves_pages_and_stops_clean(tmp_path):
    require_mooncake()
    cmd = [sys.executable, "-m", "radixserve", "kv-store", "--start-master",
           "--segment-size", "64MB", "--log-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["segment_bytes"] == 64 << 20
        lo, hi = map(int, ready["te_port_range"].split("-"))
        assert hi < 32768 and lo <= int(ready["transport_endpoint"].rsplit(":", 1)[1]) <= hi
        fmt = PageFormat("model=m", 4096)
        cfg = {"master_server_address": ready["master"], **backend_ports(pin_this_process())}
        b = create_backend("mooncake", fmt, cfg)
        assert b.put_pages(["k1", "k2"], [b"a" * 4096, b"b" * 4096]) == 2
        out = [bytearray(4096), bytearray(4096)]
        assert b.get_pages(["k1", "k2"], out) == 2 and out[1] == b"b" * 4096
        b.close()
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)],
                    capture_output=True, text=True).stdout.split()]  # fmt: skip
        assert len(children) == 2
        # a second store process joins the same master: the pool grows by its segment
        second = subprocess.Popen([sys.executable, "-m", "radixserve", "kv-store",
                                   "--master-address", ready["master"],
                                   "--master-metrics-address", ready["metrics"],
                                   "--segment-size", "32MB", "--log-dir", str(tmp_path / "2")],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            joined = json.loads(second.stdout.readline())
            assert joined["transport_endpoint"] != ready["transport_endpoint"]
            sizes = {s["segment_name"]: s["size_bytes"] for s in segments(ready["metrics"])}
            assert sizes == {ready["segment"]: 64 << 20, joined["segment"]: 32 << 20}
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not any(_alive(pid) for pid in children)


def test_kv_store_bad_flags_are_one_line_errors():
    for args, message in ((["--start-master", "--segment-size", "lots"], "not a size"),
                          ([], "exactly one of --master-address or --start-master"),
                          (["--start-master", "--te-port-range", "40000-40100"], "1024-32767")):  # fmt: skip
        out = subprocess.run([sys.executable, "-m", "radixserve", "kv-store", *args],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
