"""``cpdata bench``: measure cpdata against the anchors, side by side, in one run.

    cpdata bench [--quick] [--runs N] [--sections a,b] [--calibration PATH] [--seed N] [--lengths PATH]
                 [--json PATH] [--markdown [PATH]]
    cpdata bench --from-json PATH --markdown       # render a saved run, measure nothing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cpdata.bench.corpus import read_corpus
from cpdata.bench.report import render_markdown
from cpdata.bench.runner import SECTIONS, check_corpus, parse_sections, run_bench, write_json
from cpdata.layout.world_cost import WorldCost

__all__ = ["register"]


def _main(args: argparse.Namespace) -> int:
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        if args.markdown is None:
            args.markdown = "-"
    else:
        try:  # an unknown section, a calibration or corpus that cannot be read: refused before anything runs
            sections = parse_sections(args.sections)
            cost = None if args.calibration is None else WorldCost.from_json(args.calibration)
            corpus = None if args.lengths is None else read_corpus(args.lengths)
            check_corpus(sections, corpus)
        except (OSError, TypeError, ValueError) as err:
            print(f"cpdata bench: {err}", file=sys.stderr)
            return 2
        results = run_bench(sections, quick=args.quick, runs=args.runs, cost=cost, seed=args.seed, corpus=corpus)
        if args.json:
            write_json(results, args.json)
    if args.markdown is not None:
        text = render_markdown(results)
        if args.markdown == "-":
            print(text)
        else:
            Path(args.markdown).write_text(text, encoding="utf-8")
    return 0


def _runs(text: str) -> int:
    """``--runs``: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}; e.g. --runs 3 for medians of three")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand to the ``cpdata`` dispatcher."""
    p = subparsers.add_parser("bench", help="measure cpdata against in-step sharding and NeMo-style gather",
                              description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (under 2 minutes on 2 cores)")
    p.add_argument("--runs", metavar="N", type=_runs, default=1,
                   help="run every section N times and report each row's median (default 1)")
    p.add_argument("--sections", metavar="A,B", help=f"subset to run, from {','.join(SECTIONS)}")
    p.add_argument("--calibration", metavar="PATH",
                   help="a cost file (make gpu-check's calibration.json) for the world deal and its predicted ms")
    p.add_argument("--seed", metavar="N", type=int, default=1,
                   help="the seed the world section draws its documents' lengths with (default 1)")
    p.add_argument("--lengths", metavar="PATH",
                   help="a corpus's document lengths in tokens (.npy, or text: one integer per document) the world "
                        "section measures instead of its distributions")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", nargs="?", const="-",
                   help="also render the benchmark tables (docs/benchmarks.md) as markdown (to PATH, or stdout)")
    p.add_argument("--from-json", metavar="PATH", help="render a saved results JSON instead of running")
    p.set_defaults(func=_main)
