"""``cpdata tokenize`` and ``cpdata pack-store``: JSONL to a binary token store."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_tokenizer_options", "register_pack_store", "register_tokenize", "row_tokenizer", "run"]


def add_tokenizer_options(p: argparse.ArgumentParser, *, required: bool) -> None:
    """``--tokenizer`` and the options of :class:`cpdata.sources.tokenizer.RowTokenizer` (shared with ``precompute``)."""
    p.add_argument("--tokenizer", required=required, metavar="PATH",
                   help="tokenizer.json file or saved tokenizer folder (transformers / tokenizers; local only)")  # fmt: skip
    p.add_argument("--append-eos", action="store_true", help="append EOS to every text row (Megatron --append-eod)")
    p.add_argument("--eos-token-id", type=int, default=None, help="EOS id (default: the tokenizer's)")
    p.add_argument("--assistant-only", action="store_true",
                   help="chat rows keep assistant_masks from the chat template's {%% generation %%} blocks")  # fmt: skip
    p.add_argument("--max-length", type=int, default=None,
                   help="keep at most this many tokens per document (counted; independent of --capacity)")  # fmt: skip
    p.add_argument("--chat-template", metavar="FILE", default=None, help="Jinja chat template overriding the tokenizer's")


def row_tokenizer(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from cpdata.sources.tokenizer import RowTokenizer

    template = Path(args.chat_template).read_text() if args.chat_template else None
    return RowTokenizer(args.tokenizer, append_eos=args.append_eos, eos_token_id=args.eos_token_id,
                        assistant_only=args.assistant_only, max_length=args.max_length, chat_template=template)  # fmt: skip


def _common(p: argparse.ArgumentParser, vocab_default: str) -> None:
    p.add_argument("--out", required=True,
                   help="output store directory (written atomically); with --format megatron the PREFIX of "
                   "PREFIX.bin and PREFIX.idx")  # fmt: skip
    p.add_argument("--format", choices=("cpdata", "megatron"), default="cpdata",
                   help="cpdata: a token store (default; keeps labels and masks, per-file sha256); megatron: "
                   "Megatron's indexed dataset, as preprocess_data.py writes it (input_ids only)")  # fmt: skip
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"ids must be below it; <= 65536 stores 2 bytes per token (default: {vocab_default})")  # fmt: skip
    p.add_argument("--workers", type=int, default=1, help="converter processes (default 1; output is the same)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def register_tokenize(subparsers: Any) -> None:
    """Add ``tokenize``."""
    p = subparsers.add_parser(
        "tokenize",
        help="tokenize a JSONL of text or chat rows into a token store",
        description="Tokenize INPUT, a .jsonl of {\"text\": ...} or {\"messages\": [...]} rows, into a binary token "
        "store (tokens.bin + offsets index + manifest) that precompute, open_dataset and build_loader read "
        "with an O(1) open.",
    )
    p.add_argument("input", metavar="INPUT", help=".jsonl of text or chat rows")
    add_tokenizer_options(p, required=True)
    _common(p, "the tokenizer's size")


def register_pack_store(subparsers: Any) -> None:
    """Add ``pack-store``."""
    p = subparsers.add_parser(
        "pack-store",
        help="convert a tokenized JSONL into a token store (no rescan on every open)",
        description="Convert INPUT, a .jsonl of {\"input_ids\": [...]} rows (plus per-token lists such as labels "
        "or loss_mask), into a binary token store, so opening it is O(1) instead of a full JSONL scan. INPUT may "
        "also be a token store: it is checked and rewritten in this cpdata's format (stores written before chunk "
        "checksums then open in O(1) again).",
    )
    p.add_argument("input", metavar="INPUT", help=".jsonl of input_ids rows, or a token store to rewrite")
    _common(p, "none: 4 bytes per token, any id below 2**32; with a token store INPUT, its own")


def run(args: argparse.Namespace) -> int:
    from cpdata.offline.tokenize_files import convert_jsonl
    from cpdata.sources.tokenstore import is_token_store, rewrite_token_store

    tokenizer = row_tokenizer(args) if getattr(args, "tokenizer", None) else None
    if tokenizer is None and args.format == "cpdata" and is_token_store(args.input):
        if args.vocab_size is not None or args.workers != 1:
            raise ValueError("rewriting a token store keeps its own vocabulary and needs no workers: leave "
                             "--vocab-size and --workers out")  # fmt: skip
        out, stats = rewrite_token_store(args.input, args.out, overwrite=args.force), {}
    else:
        out, stats = convert_jsonl(args.input, args.out, fmt=args.format, tokenizer=tokenizer, vocab_size=args.vocab_size,
                                   workers=args.workers, overwrite=args.force, progress=not args.quiet)  # fmt: skip
    if args.format == "megatron":
        line = (f"wrote {out.bin_path} and {out.idx_path.name}: {len(out)} documents, {int(out.lengths.sum())} "
                f"tokens ({out.dtype.name})")  # fmt: skip
    else:
        m = out.manifest
        line = (f"wrote {out.path}: {m['documents']} documents, {m['tokens']} tokens "
                f"({m['dtype']}, ids {m['min_id']}..{m['max_id']})")  # fmt: skip
    if stats:
        line += (f"; {stats['chat']} chat rows, EOS appended {stats['eos_appended']}, truncated {stats['truncated']} "
                 f"({stats['truncated_tokens']} tokens)")  # fmt: skip
    print(line)
    return 0
