"""`radixserve` command line: one subcommand per part that works, each built from its config
dataclasses (see ``radixserve.config``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from radixserve import __version__
from radixserve.config import CliParser

# subcommand -> module with ``add_parser(subparsers)``; the module's ``run(args)`` does the work.
# Listed here only once the subcommand works end to end.
SUBCOMMANDS: dict[str, str] = {
    "serve": "radixserve.server.cli",
    "route": "radixserve.router.proxy.cli",
    "epp": "radixserve.router.gateway",
    "kv-indexer": "radixserve.router.indexer.cli",
    "kv-store": "radixserve.kvstore.cli",
    "sim": "radixserve.sim.cli",
    "bench": "radixserve.bench.cli",
    "playground": "radixserve.playground.cli",
}


def build_parser() -> CliParser:
    parser = CliParser(
        prog="radixserve", description="LLM serving built around prefix KV-cache reuse."
    )
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    # every subcommand's parser is a CliParser: a bad value is one line, exit status 2
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CliParser)
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad value already told in one line
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
