"""`radixserve kv-store`: the process whose memory segment holds the storage tier's pages for
every engine (Mooncake's `mooncake_client`), optionally with a Mooncake master beside it."""

# Engines mount no segment of their own, so what they write lives here and outlives them. Every
# port is explicit: given by a flag, or chosen free here and printed on the ready line (never
# Mooncake's defaults); the transfer-engine ports come from windows below 32768 (Mooncake refuses
# the ephemeral range). The command prints one ready line (JSON) once the master lists the
# segment, then waits; SIGINT/SIGTERM stop the children; a child that dies ends the command.

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from radixserve.kvstore import mooncake_procs as mp

_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def parse_size(text: str) -> int:
    """'4GB', '512 MB', '1073741824' -> bytes (binary units, as Mooncake reads them)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", text.upper())
    if m is None or (m.group(2) and m.group(2) not in _UNITS):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GB, 512MB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def parse_range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)-(\d+)", text.strip())
    if m is None or not 1024 <= int(m.group(1)) <= int(m.group(2)) < 32768:
        raise argparse.ArgumentTypeError(f"port range {text!r}: LOW-HIGH within 1024-32767")
    return int(m.group(1)), int(m.group(2))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv-store", help="hold the shared KV storage segment (Mooncake Store)",
                       description=__doc__)  # fmt: skip
    g = p.add_argument_group("master")
    g.add_argument("--master-address", help="HOST:PORT of a running mooncake_master's RPC")
    g.add_argument(
        "--master-metrics-address",
        help="HOST:PORT of that master's metrics/admin HTTP (to confirm the mount)",
    )
    g.add_argument("--start-master", action="store_true", help="start a mooncake_master too")
    g.add_argument("--master-port", type=int, default=0, help="its RPC port (0: a free one)")
    g.add_argument(
        "--master-metrics-port",
        type=int,
        default=0,
        help="its metrics/admin HTTP port, /batch_query_keys (0: a free one)",
    )
    g.add_argument(
        "--client-ttl",
        type=int,
        default=10,
        help="seconds the master keeps a silent client's segment",
    )
    g = p.add_argument_group("store")
    g.add_argument(
        "--segment-size",
        type=parse_size,
        default=parse_size("4GB"),
        help="memory this process contributes to the pool (default 4GB)",
    )
    g.add_argument("--host", default="127.0.0.1", help="address the store is reached at")
    g.add_argument("--client-port", type=int, default=0, help="its client port (0: a free one)")
    g.add_argument("--service-port", type=int, default=0, help="its service port (0: free)")
    g.add_argument(
        "--te-port-range",
        type=parse_range,
        help="transfer-engine ports LOW-HIGH (default: a free window below 32768)",
    )
    g.add_argument("--log-dir", help="where the children's logs go (default: a temp dir)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.master_address) == bool(args.start_master):
        print("radixserve kv-store: give exactly one of --master-address or --start-master",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        mp.binary("mooncake_client")
    except mp.MooncakeNotInstalled as exc:
        print(f"radixserve kv-store: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="radixserve-kv-store-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    master = store = None
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    try:
        master, master_rpc, metrics = _start_master(args, log_dir)
        store, ready = _start_store(args, log_dir, master_rpc, metrics)
        print(json.dumps(ready), flush=True)
        while not stopping:
            for name, proc in (("mooncake_master", master), ("mooncake_client", store)):
                if proc is not None and proc.poll() is not None:
                    print(f"radixserve kv-store: {name} exited ({proc.returncode}); see {log_dir}",
                          file=sys.stderr)  # fmt: skip
                    return 1
            time.sleep(0.2)
        return 0
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"radixserve kv-store: {exc}; logs in {log_dir}", file=sys.stderr)
        return 1
    finally:
        mp.stop(store)
        mp.stop(master)


def _start_master(args, log_dir: Path):
    if not args.start_master:
        host, _, port = args.master_address.rpartition(":")
        if not host or not port.isdigit():
            raise RuntimeError(f"--master-address {args.master_address!r} is not HOST:PORT")
        metrics = args.master_metrics_address
        if metrics is not None and not re.fullmatch(r"[^:\s]+:\d+", metrics):
            raise RuntimeError(f"--master-metrics-address {metrics!r} is not HOST:PORT")
        return None, args.master_address, metrics
    ports = mp.MasterPorts(args.master_port or mp.free_port(),
                           args.master_metrics_port or mp.free_port(), mp.free_port())  # fmt: skip
    proc = mp.spawn(mp.master_command(ports, args.client_ttl), None, log_dir / "master.log")
    metrics = f"127.0.0.1:{ports.metrics}"
    mp.wait_until(lambda: mp.master_healthy(metrics), "mooncake_master", proc, mp.READY_TIMEOUT_S)
    return proc, f"127.0.0.1:{ports.rpc}", metrics


def _start_store(args, log_dir: Path, master_rpc: str, metrics: str | None):
    client_port, service_port = (
        args.client_port or mp.free_port(),
        args.service_port or mp.free_port(),
    )
    te = args.te_port_range or mp.port_window()
    env = mp.port_env(te, mp.port_window(16))
    cmd = mp.store_command(master_rpc, args.host, client_port, service_port, args.segment_size)
    proc = mp.spawn(cmd, env, log_dir / "store.log")
    segment = f"{args.host}:{client_port}"
    ready = {"ready": True, "master": master_rpc, "metrics": metrics, "segment": segment,
             "segment_bytes": args.segment_size, "te_port_range": f"{te[0]}-{te[1]}",
             "pid": proc.pid, "logs": str(log_dir)}  # fmt: skip
    if metrics is None:  # an outside master, its admin address not given: the log line says it
        mp.wait_until(lambda: "Starting real client service" in _read(log_dir / "store.log"),
                      "mooncake_client", proc, mp.READY_TIMEOUT_S)  # fmt: skip
        return proc, ready
    mp.wait_until(lambda: mp.segment_of(metrics, segment) is not None, "mooncake_client segment",
                  proc, mp.READY_TIMEOUT_S)  # fmt: skip
    ready["transport_endpoint"] = mp.segment_of(metrics, segment)["te_endpoint"]
    return proc, ready


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
