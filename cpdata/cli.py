"""``cpdata`` command line: one subcommand per module, imported on demand.

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``func(args) -> int`` as the handler.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

_SUBCOMMANDS: dict[str, str] = {
    "bench": "cpdata.bench.cli",
    "inspect": "cpdata.offline.inspect_cli",
    "precompute": "cpdata.offline.precompute_cli",
}


def _parser(selected: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpdata", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(sorted(_SUBCOMMANDS)) + "}")
    for name, module in sorted(_SUBCOMMANDS.items()):
        if selected is None or name == selected:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=f"see `cpdata {name} --help`")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if a in _SUBCOMMANDS), None)
    args = _parser(selected).parse_args(argv)
    if getattr(args, "func", None) is None:
        _parser(None).print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
