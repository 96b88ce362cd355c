"""JSONL files to a token store (or a Megatron ``.bin``/``.idx``), in parallel: ``cpdata tokenize`` and
``cpdata pack-store`` (their command lines too).

Chunks of lines go to spawned worker processes (numpy and the tokenizer only) and come back in file order, so
the output is byte-identical for any ``workers``. ``tokenize`` lines are text or chat rows
(:class:`~cpdata.sources.tokenizer.RowTokenizer`); ``pack-store`` lines carry ``input_ids`` and per-token lists.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.errors import check_int
from cpdata.offline.progress import Progress
from cpdata.sources.base import json_row, token_row
from cpdata.sources.megatron import MegatronIndexed
from cpdata.sources.megatron_writer import write_megatron
from cpdata.sources.tokenizer import RowTokenizer
from cpdata.sources.tokenstore import TokenStore, is_token_store, rewrite_token_store, write_token_store

__all__ = ["add_tokenizer_options", "convert_jsonl", "register_pack_store", "register_tokenize", "row_tokenizer",
           "run"]

_CHUNK_LINES = 512
_convert: RowTokenizer | None = None


def _init(convert: RowTokenizer | None) -> None:
    global _convert
    _convert = convert


def _run_chunk(chunk: tuple[str, int, list[tuple[int, int, bytes]]]) -> tuple[list[dict[str, np.ndarray]],
                                                                            dict[str, int]]:
    """Documents of a chunk's ``(line number, byte offset, line)``s: ``pack-store`` rows (no converter) as
    :class:`~cpdata.sources.files.JsonlDocuments` reads them, every per-token list kept; else converted."""
    path, first_doc, lines = chunk
    if _convert is None:
        return [token_row(json_row(line, Path(path), n, offset), f"{path} line {n}", every_list=True)
                for n, offset, line in lines], {}  # fmt: skip
    docs = []
    before = _convert.stats.as_dict()
    for k, (lineno, offset, line) in enumerate(lines):
        row = json_row(line, Path(path), lineno, offset)
        try:
            docs.append(_convert(row, first_doc + k))
        except (ValueError, TypeError) as e:
            raise type(e)(f"{path} line {lineno}: {e}") from None
    after = _convert.stats.as_dict()
    return docs, {k: after[k] - before[k] for k in after}


def _chunks(path: Path, bar: Progress) -> Iterator[tuple[str, int, list[tuple[int, int, bytes]]]]:
    lines: list[tuple[int, int, bytes]] = []
    docs = offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            bar.update(len(line))
            if line.strip():
                lines.append((lineno, offset, line))
            offset += len(line)
            if len(lines) == _CHUNK_LINES:
                yield str(path), docs, lines
                docs += len(lines)
                lines = []
    if lines:
        yield str(path), docs, lines


def _converted(src: Path, convert: RowTokenizer | None, workers: int, bar: Progress,
               totals: dict[str, int]) -> Iterator[dict[str, np.ndarray]]:  # fmt: skip
    """Every converted document of ``src`` in file order; the converter's counters are added to ``totals``."""
    if workers == 1:
        _init(convert)
        results: Iterator[Any] = map(_run_chunk, _chunks(src, bar))
    else:
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init, initargs=(convert,))
        results = pool.imap(_run_chunk, _chunks(src, bar))
    try:
        for docs, stats in results:
            yield from docs
            for key, value in stats.items():
                totals[key] = totals.get(key, 0) + value
    finally:
        if workers > 1:
            pool.terminate()
            pool.join()


def convert_jsonl(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    fmt: str = "cpdata",
    tokenizer: RowTokenizer | None = None,
    vocab_size: int | None = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = False,
) -> tuple[TokenStore | MegatronIndexed, dict[str, int]]:
    """Convert a JSONL file into a token store at ``out`` (``fmt="cpdata"``, atomically) or a Megatron
    ``PREFIX.bin`` + ``PREFIX.idx`` (``"megatron"``, ``input_ids`` only); returns it, opened, and the tokenizer's
    counters.

    ``tokenizer``: text/chat lines through it (``cpdata tokenize``); None reads ``input_ids`` lines (``cpdata
    pack-store``). ``vocab_size`` defaults to ``len(tokenizer)``; ``workers``: converter processes (1: none)."""
    src = Path(path)
    if not src.is_file():
        raise ValueError(f"input {str(src)!r} does not exist or is not a file; pass a .jsonl file")
    check_int("workers", workers, min=1)
    assistant_only = tokenizer is not None and tokenizer.assistant_only
    if fmt == "megatron" and assistant_only:
        raise ValueError("--assistant-only keeps assistant_masks, but a Megatron indexed dataset holds input_ids "
                         "only; write a token store (--format cpdata) to keep them")  # fmt: skip
    if vocab_size is None and tokenizer is not None:
        vocab_size = tokenizer.vocab_size
    totals: dict[str, int] = {}
    with Progress(src.stat().st_size, f"{'tokenizing' if tokenizer else 'reading'} {src.name}", unit="B",
                  enabled=progress) as bar:  # fmt: skip
        documents = _converted(src, tokenizer, workers, bar, totals)
        if fmt == "megatron":
            return write_megatron(documents, out, vocab_size=vocab_size, overwrite=overwrite), totals
        # totals fill as the documents are read: complete when the manifest is written
        source = {"name": src.name, "bytes": src.stat().st_size, "stats": totals,
                  "tokenizer": None if tokenizer is None else str(tokenizer.source)}  # fmt: skip
        return write_token_store(documents, out, vocab_size=vocab_size, overwrite=overwrite, source=source,
                                 labels_alignment="inputs" if assistant_only else None, name=str(src)), totals


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


def row_tokenizer(args: argparse.Namespace) -> RowTokenizer:
    template = Path(args.chat_template).read_text() if args.chat_template else None
    return RowTokenizer(args.tokenizer, append_eos=args.append_eos, eos_token_id=args.eos_token_id,
                        assistant_only=args.assistant_only, max_length=args.max_length, chat_template=template)  # fmt: skip


def _register(subparsers: Any, name: str, summary: str, description: str, input_help: str,
              vocab_default: str) -> argparse.ArgumentParser:  # fmt: skip
    """Add ``name`` with INPUT and the options ``tokenize`` and ``pack-store`` share."""
    p = subparsers.add_parser(name, help=summary, description=description)
    p.add_argument("input", metavar="INPUT", help=input_help)
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
    p.set_defaults(func=run, tokenizer=None)  # pack-store has no --tokenizer
    return p


def register_tokenize(subparsers: Any) -> None:
    """Add ``tokenize``."""
    p = _register(subparsers, "tokenize", "tokenize a JSONL of text or chat rows into a token store",
                  "Tokenize INPUT, a .jsonl of {\"text\": ...} or {\"messages\": [...]} rows, into a binary token "
                  "store (tokens.bin + offsets index + manifest) that precompute, open_dataset and build_loader "
                  "read with an O(1) open.", ".jsonl of text or chat rows", "the tokenizer's size")  # fmt: skip
    add_tokenizer_options(p, required=True)


def register_pack_store(subparsers: Any) -> None:
    """Add ``pack-store``."""
    _register(subparsers, "pack-store", "convert a tokenized JSONL into a token store (no rescan on every open)",
              "Convert INPUT, a .jsonl of {\"input_ids\": [...]} rows (plus per-token lists such as labels or "
              "loss_mask), into a binary token store, so opening it is O(1) instead of a full JSONL scan. INPUT may "
              "also be a token store: it is checked and rewritten in this cpdata's format (stores written before "
              "chunk checksums then open in O(1) again).", ".jsonl of input_ids rows, or a token store to rewrite",
              "none: 4 bytes per token, any id below 2**32; with a token store INPUT, its own")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    tokenizer = row_tokenizer(args) if args.tokenizer else None
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
