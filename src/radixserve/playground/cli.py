"""`radixserve playground`: serve the page over the simulator (and, with --router-url, the fleet
view of a running router)."""

from __future__ import annotations

import argparse
import sys
from urllib.parse import urlparse

from radixserve.config import bounded
from radixserve.net import bind


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `playground` subcommand."""
    parser = subparsers.add_parser(
        "playground",
        help="a web page: scheduling policies on the real scheduler, and a live fleet view",
        description=(
            "Serve a page that runs this project's scheduler and radix cache through the "
            "simulator: FCFS against LPM and the other policies, hit rate against shared-prefix "
            "probability, the fairness trade-off and a 6-request trace. With --router-url it "
            "also shows a running router's workers, refreshed live."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=bounded(int, ge=0, le=65535), default=8080, help="port (0: any free one)"
    )
    parser.add_argument(
        "--router-url", type=_router_url, help="a `radixserve route` to show in the fleet view"
    )
    parser.add_argument(
        "--log-level", default="warning", help="uvicorn log level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )  # fmt: skip
    parser.set_defaults(run=run)
    return parser


def _router_url(text: str) -> str:
    url = urlparse(text)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise argparse.ArgumentTypeError(f"must be http(s)://host:port, got {text!r}")
    return text


def run(args: argparse.Namespace) -> int:
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"radixserve playground: cannot listen on {args.host}:{args.port}: {e}",
              file=sys.stderr)  # fmt: skip
        return 2
    return _serve(args, sock)


def _serve(args: argparse.Namespace, sock) -> int:  # noqa: ANN001
    import uvicorn

    from radixserve.playground.app import create_app

    host, port = sock.getsockname()[:2]
    sock.listen(128)  # connections queue up while uvicorn starts: the URL works once printed
    print(f"radixserve playground: http://{host}:{port}/", flush=True)
    config = uvicorn.Config(create_app(args.router_url), log_level=args.log_level)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0
