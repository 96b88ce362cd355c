"""``cpdata`` command line: one subcommand per module, imported on demand.

Each subcommand module's ``register(subparsers)`` adds its parser and sets ``func(args) -> int``. A
``ValueError``, ``TypeError`` or ``OSError`` it raises is printed as ``cpdata CMD: error: ...`` with the
library's keywords written as the command's flags (:func:`cli_wording`), and :func:`main` returns 1.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from collections.abc import Sequence

__all__ = ["cli_wording", "main"]

_SUBCOMMANDS: dict[str, str] = {
    "bench": "cpdata.bench.cli",
    "inspect": "cpdata.offline.inspect_cli",
    "pack-store": "cpdata.offline.tokenize_files:register_pack_store",
    "precompute": "cpdata.offline.precompute_cli",
    "tokenize": "cpdata.offline.tokenize_files:register_tokenize",
}
"""Subcommand -> ``module`` (with ``register``) or ``module:function``."""

_DESCRIPTION = """\
cpdata prepares context-parallel training batches: it packs tokenized documents, lays each pack out for
your attention backend (Transformer Engine THD, torch context_parallel, flash-attn varlen, all-gather)
and hands every CP rank only its own tokens. The commands below work ahead of training, on files."""

_EPILOG = """\
typical use:
  cpdata tokenize data.jsonl --tokenizer tok/ --out tokens/        text or chat rows -> token store
  cpdata precompute tokens/ --capacity 8192 --cp-size 4 --layout thd --out plan/
  cpdata inspect plan/ --pack 3 --plot pack3.png                   padding and per-rank work
  cpdata bench --quick                                             speed of this machine

Run `cpdata COMMAND --help` for a command's options. In Python: `from cpdata import build_loader`."""


def cli_wording(message: str, flags: Sequence[str]) -> str:
    """``message`` with the library's ``name=value`` keywords written as the command's flags (argument dests).

    ``overwrite=True (--force)`` becomes ``--force``, ``capacity=30`` ``--capacity 30``, ``overflow= one of
    [...]`` ``--overflow one of [...]``.
    """
    known = set(flags)
    if "force" in known:  # the library's overwrite=True is the commands' --force
        message = re.sub(r"\boverwrite=True(?: \(--force\))?", "--force", message)

    def reword(m: re.Match[str]) -> str:
        name, value = m.group(1), m.group(2)
        if name not in known:
            return m.group(0)
        return "--" + name.replace("_", "-") + (f" {value}" if value else "")

    return re.sub(r"(?<![^\s(])([a-z][a-z0-9_]*)=(\S*)", reword, message)


def _parser(selected: str | None) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The parser and its subcommands, with only ``selected``'s module imported (None: every one)."""
    from cpdata import __version__

    parser = argparse.ArgumentParser(
        prog="cpdata",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cpdata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, target in sorted(_SUBCOMMANDS.items()):
        if selected is None or name == selected:
            module, _, function = target.partition(":")
            getattr(importlib.import_module(module), function or "register")(sub)
        else:
            sub.add_parser(name, help=f"see `cpdata {name} --help`")
    return parser, sub


def _check_options(sub: argparse.ArgumentParser, selected: str, argv: Sequence[str]) -> None:
    """Name a misspelt ``--flag`` and its close match, before argparse reports a required one missing instead."""
    known = sorted(s for s in sub._option_string_actions if s.startswith("--"))
    for arg in argv:
        if arg == "--":
            return
        name = arg.partition("=")[0]
        if not name.startswith("--") or any(k.startswith(name) for k in known):  # argparse takes prefixes
            continue
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"`cpdata {selected} --help` lists the options"
        sub.error(f"unrecognized argument {name}; {hint}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if a in _SUBCOMMANDS), None)
    parser, commands = _parser(selected)
    if selected is not None:
        _check_options(commands.choices[selected], selected, argv)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        _parser(None)[0].print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError) as e:
        print(f"cpdata {args.command}: error: {cli_wording(str(e), list(vars(args)))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
