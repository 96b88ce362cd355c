"""``cpdata precompute``: plan a tokenized dataset into a plan directory."""

from __future__ import annotations

import argparse
from typing import Any

from cpdata.errors import check_choice
from cpdata.layout.maps import LAYOUTS
from cpdata.layout.tiled import TILES
from cpdata.nodes.options import DataPolicy, PlanChoice, SchedulePlan, StreamPlan
from cpdata.offline.tokenize_files import add_tokenizer_options, convert_jsonl, row_tokenizer

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add ``precompute`` to the ``cpdata`` command line."""
    from cpdata.packing import ALGORITHMS, DEFAULT_ALGORITHM, DEFAULT_WINDOW, OVERFLOW_POLICIES

    p: argparse.ArgumentParser = subparsers.add_parser(
        "precompute",
        help="pack a whole tokenized dataset ahead of training into a plan directory",
        description="Pack a whole tokenized dataset ahead of training. INPUT is a .npy/.npz of document "
        "lengths, a .jsonl file of {\"input_ids\": [...]} rows, a folder of .npy token arrays "
        "(one document per file, in name order), a token store (cpdata tokenize / pack-store) or a "
        "datasets.Dataset saved with save_to_disk. With --tokenizer, INPUT is a .jsonl of {\"text\"} or "
        "{\"messages\"} rows: it is first tokenized into a token store (--tokens-out), then planned. "
        "Serve the result with cpdata.PrecomputedPacks. Instead of INPUT, --mix NAME=PATH:WEIGHT (repeated) plans "
        "the documents cpdata.mix draws from several tokenized datasets; serve it with "
        "PrecomputedPacks(OUT, cpdata.mix({NAME: open_dataset(PATH), ...}, {NAME: WEIGHT, ...}, seed=, stop=, by=)).",
    )
    p.add_argument("input", metavar="INPUT", nargs="?", default=None,
                   help="tokenized dataset, or text/chat .jsonl with --tokenizer (or use --mix)")  # fmt: skip
    p.add_argument("--mix", metavar="NAME=PATH:WEIGHT", action="append", default=None,
                   help="a source of a weighted mix (repeat per source), e.g. --mix web=web.jsonl:0.7 "
                   "--mix chat=chat.jsonl:0.3; every PATH as for INPUT")  # fmt: skip
    p.add_argument("--mix-stop", default="first_exhausted",
                   help="with --mix: first_exhausted (default), all_exhausted (smaller sources repeat)")
    p.add_argument("--mix-seed", type=int, default=0, help="with --mix: seed of the draws (default 0)")
    p.add_argument("--mix-by", choices=("documents", "tokens"), default="documents",
                   help="with --mix: the weights share out documents (default) or tokens (cpdata.mix(by=...))")
    p.add_argument("--epochs", type=int, default=1,
                   help="with --mix: epochs to plan, each over that epoch's draws (default 1; PrecomputedPacks "
                   "refuses a later epoch)")  # fmt: skip
    p.add_argument("--capacity", type=int, required=True, help="tokens per pack")
    p.add_argument("--cp-size", type=int, required=True, help="context-parallel ranks the packs are laid out for")
    p.add_argument("--layout", choices=LAYOUTS, required=True, help="CP layout (sets the per-document alignment)")
    p.add_argument("--tile", type=int, default=None, choices=TILES,
                   help="with --layout tiled: the kernel's tile (default 128); packs are multiples of cp * tile")
    p.add_argument("--algorithm", choices=ALGORITHMS, default=DEFAULT_ALGORITHM,
                   help=f"packing algorithm (default: {DEFAULT_ALGORITHM})")
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES, default=None,
                   help="documents longer than the capacity (default: error; split for concat)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="planner seed (default: 0)")
    p.add_argument("--window", type=int, default=None,
                   help=f"documents per planning window (default: {DEFAULT_WINDOW}; all for ffd)")  # fmt: skip
    p.add_argument("--vocab-size", type=int, default=None,
                   help="refuse token ids >= this (negative ids are always refused)")  # fmt: skip
    p.add_argument("--labels-alignment", choices=("inputs", "targets"), default=None,
                   help="meaning of the rows' labels / loss masks, required when they carry any: 'inputs' (aligned "
                   "with input_ids, the model shifts: Hugging Face, TRL, torchtune) or 'targets' (already next-token "
                   "targets: Megatron, NeMo)")  # fmt: skip
    p.add_argument("--dp-size", type=int, default=None,
                   help="plan a global schedule for this many DP ranks (equal steps per rank, each reads its own)")
    p.add_argument("--micro-batches", type=int, default=1, help="packs per DP rank per step (with --dp-size)")
    p.add_argument("--schedule", choices=("balanced", "in_order"), default="balanced",
                   help="with --dp-size: cost-balanced packs (default) or today's packs in order")
    p.add_argument("--max-delay", type=int, default=0,
                   help="with --dp-size: steps a long document may wait for partners of its size (default 0)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--force", action="store_true", help="replace existing output directories")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    add_tokenizer_options(p, required=False)
    p.add_argument("--tokens-out", metavar="DIR", default=None,
                   help="with --tokenizer: where the token store goes (default: OUT.tokens beside OUT)")  # fmt: skip
    p.add_argument("--workers", type=int, default=1, help="with --tokenizer: tokenizing processes (default 1)")
    p.set_defaults(func=run)


def parse_mix(entries: list[str], *, seed: int, stop: str, by: str = "documents") -> Any:
    """``["web=web.jsonl:0.7", ...]`` -> ``cpdata.mix({"web": open_dataset("web.jsonl"), ...}, ...)``."""
    from cpdata.nodes.mix import STOP_POLICIES, check_weights, mix
    from cpdata.sources.open import open_dataset

    check_choice("stop policy", stop, STOP_POLICIES, fix=" (--mix-stop)")  # before any file is opened
    paths: dict[str, str] = {}
    weights: dict[str, float] = {}
    for entry in entries:
        name, eq, rest = entry.partition("=")
        path, colon, weight = rest.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if not (name and eq and path and colon) or value is None:
            raise ValueError(f"--mix {entry!r} must be NAME=PATH:WEIGHT, e.g. --mix web=data/web.jsonl:0.7")
        if name in paths:
            raise ValueError(f"--mix names source {name!r} twice; give each source one --mix NAME=PATH:WEIGHT")
        paths[name], weights[name] = path, value
    check_weights(dict.fromkeys(paths), weights)  # before any file is opened
    return mix({name: open_dataset(path) for name, path in paths.items()}, weights, seed=seed, stop=stop, by=by)


def _plan(args: argparse.Namespace) -> PlanChoice:
    """``--dp-size`` plans a global schedule (with ``--schedule``, ``--micro-batches``, ``--max-delay``); without
    it, the packs of the streaming packer (with ``--window``)."""
    if args.dp_size is None:
        if args.micro_batches != 1 or args.max_delay:
            raise ValueError("--micro-batches and --max-delay shape a global schedule: pass --dp-size with them")
        return StreamPlan(algorithm=args.algorithm, overflow=args.overflow, window=args.window)
    if args.window is not None:
        raise ValueError("--window sets the streaming packer's window; a global schedule (--dp-size) plans every "
                         "document at once: leave --window out")  # fmt: skip
    return SchedulePlan(kind=args.schedule, micro_batches=args.micro_batches, max_delay=args.max_delay,
                        algorithm=args.algorithm, overflow=args.overflow)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from cpdata.offline.precompute_plan import precompute

    data = args.input
    if args.mix:
        if args.input is not None or args.tokenizer:
            raise ValueError("--mix replaces INPUT (and --tokenizer): tokenize each source first, then mix the stores")
        data = parse_mix(args.mix, seed=args.mix_seed, stop=args.mix_stop, by=args.mix_by)
    elif args.input is None:
        raise ValueError("pass INPUT (a tokenized dataset) or --mix NAME=PATH:WEIGHT at least once")
    if args.tokenizer:
        tokens_out = args.tokens_out or f"{str(args.out).rstrip('/')}.tokens"
        tokens, _ = convert_jsonl(args.input, tokens_out, tokenizer=row_tokenizer(args), vocab_size=args.vocab_size,
                                  workers=args.workers, overwrite=args.force, progress=not args.quiet)  # fmt: skip
        print(f"wrote {tokens.path}: {len(tokens)} documents, {tokens.manifest['tokens']} tokens (serve the plan "
              "with open_dataset of this directory)")  # fmt: skip
        data = tokens
    elif args.tokens_out or args.append_eos or args.assistant_only or args.max_length or args.chat_template:
        raise ValueError("--tokens-out, --append-eos, --assistant-only, --max-length and --chat-template need "
                         "--tokenizer PATH (INPUT is then a .jsonl of text or chat rows)")  # fmt: skip
    store = precompute(data, args.out, capacity=args.capacity, cp_size=args.cp_size, layout=args.layout,
                       tile=args.tile, plan=_plan(args), overwrite=args.force, progress=not args.quiet,
                       data=DataPolicy(seed=args.seed, dp_size=args.dp_size or 1, epochs=args.epochs,
                                       vocab_size=args.vocab_size, labels_alignment=args.labels_alignment))  # fmt: skip
    m = store.manifest
    stats = m["stats"]
    print(
        f"wrote {store.path}: {m['counts']['packs']} packs of {m['config']['capacity']} tokens from "
        f"{m['input']['documents']} documents; padding {stats['padding_pct']:.2f}% "
        f"(lower bound {stats['lower_bound_pct']:.2f}%); skipped {stats['skipped']}, split {stats['split']}, "
        f"truncated {stats['truncated']}, dropped {stats['dropped']}, untrained {stats.get('untrained', 0)}"
    )
    if stats.get("sources"):
        drawn = ", ".join(f"{name} {c['documents']} documents ({c['tokens']} tokens)"
                          for name, c in stats["sources"].items())  # fmt: skip
        print(f"mix ({m['input']['mix']['stop']}): {drawn}")
        if "epochs" in m:
            print(f"mix epochs planned: {m['epochs']['count']} (each over its own draws; serving a later epoch "
                  "is refused: re-run with a larger --epochs)")  # fmt: skip
        else:
            print("mix schedule: epoch 0's draws are planned once and served every epoch, as "
                  "build_loader(plan=SchedulePlan()) does")  # fmt: skip
    if "schedule" in m:
        sc = m["schedule"]
        print(f"schedule: {sc['num_steps']} steps x {sc['dp_size']} DP ranks x {sc['micro_batches']} micro-batches "
              f"({sc['kind']}); imb_mb {100 * sc['imb_mb_mean']:.2f}%, imb_step {100 * sc['imb_step_mean']:.2f}%, "
              f"empty packs {sc['empty_packs']}, max delay {len(sc['delay_counts']) - 1} steps after the step that "
              "took a piece from the stream")
    return 0
