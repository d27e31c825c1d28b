"""`radixserve` command line: one subcommand per part that works, each built from its config
dataclasses (see ``radixserve.config``)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from radixserve import __version__

# subcommand -> module with ``add_parser(subparsers)``; the module's ``run(args)`` does the work.
# Listed here only once the subcommand works end to end.
SUBCOMMANDS: dict[str, str] = {
    "serve": "radixserve.server.cli",
    "route": "radixserve.router.proxy.cli",
    "kv-indexer": "radixserve.router.indexer.cli",
    "kv-store": "radixserve.kvstore.cli",
    "sim": "radixserve.sim.cli",
    "bench": "radixserve.bench.cli",
    "playground": "radixserve.playground.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve", description="LLM serving built around prefix KV-cache reuse."
    )
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
