"""Binary token store: one flat token file plus an offsets index, memory-mapped (like Megatron's ``.bin/.idx``).

A store directory holds ``tokens.bin`` (every document's ids back to back, uint16 when the vocabulary fits,
else uint32), ``offsets.npy`` (int64 ``[n_docs + 1]``), per-token extras ``KEY.bin`` with
``KEY.present.npy`` (bool ``[n_docs]``), and ``manifest.json`` (counts, dtype, id range, each file's sha256
and 1 MiB chunk checksums, and the manifest's own digest). Opening is O(1) in the corpus size; the first read
of a chunk in a process checks it (:mod:`cpdata.sources.chunksums`), so changed bytes raise naming the file,
byte range and document. Stores of ``format_version`` 1 (no chunk checksums) are hashed whole at open, with a
warning to rewrite them (``cpdata pack-store OLD --out NEW``). Writing is atomic.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.sources.atomic import atomic_directory
from cpdata.sources.base import TokenizedDataset
from cpdata.sources.chunksums import CHUNK_BYTES, CHUNK_HASH, ChunkChecker, legacy_chunks
from cpdata.sources.manifest import DIGEST_KEY, MANIFEST, read_manifest
from cpdata.sources.tokenstore_writer import (
    FORMAT,
    FORMAT_VERSION,
    OFFSETS_FILE,
    TOKENS_FILE,
    TokenStoreWriter,
)

__all__ = ["FORMAT", "TOKENS_FILE", "TokenStore", "TokenStoreWriter", "is_token_store", "rewrite_token_store",
           "write_token_store"]

_REWRITE = "rewrite it with `cpdata tokenize` / `cpdata pack-store`"
_DAMAGED = ("restore the store's files from where they came from, or rewrite the store with "
            "`cpdata tokenize` / `cpdata pack-store`")


def is_token_store(path: str | os.PathLike[str]) -> bool:
    """A directory holding ``tokens.bin`` (what :func:`~cpdata.sources.open.open_dataset` dispatches on)."""
    return (Path(path) / TOKENS_FILE).is_file()


def write_token_store(
    documents: Iterable[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int | None = None,
    overwrite: bool = False,
    source: Mapping[str, Any] | None = None,
    labels_alignment: str | None = None,
    name: str | None = None,
) -> TokenStore:
    """Write ``documents`` as a store at ``out_dir``, atomically; ``source`` (JSON-able) and
    ``labels_alignment`` go into the manifest; errors about a document name ``name`` (default: ``out_dir``).
    Returns the store, opened."""
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        writer = TokenStoreWriter(tmp, vocab_size=vocab_size, name=name or str(out_dir))
        for document in documents:
            writer.add(document)
        writer.finish(source or {}, labels_alignment=labels_alignment)
    return TokenStore(out_dir)


def rewrite_token_store(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> TokenStore:
    """Rewrite the store at ``src`` in this cpdata's format at ``out_dir`` (``cpdata pack-store SRC``), after
    checking every file of ``src``, so damaged bytes are never blessed."""
    old = TokenStore(src, verify=True)
    m = old.manifest
    return write_token_store((old[i] for i in range(len(old))), out_dir, vocab_size=m["vocab_size"],
                             overwrite=overwrite, source=m["source"], labels_alignment=m.get("labels_alignment"))  # fmt: skip


class TokenStore(TokenizedDataset):
    """A token store directory as a :class:`~cpdata.sources.base.TokenizedDataset` (O(1) open); ``verify`` checks
    every chunk at open instead of at first read."""

    kind = "token_store"
    _transient = ("_offsets", "_tokens", "_lengths", "_check_index", "_check_tokens", "_checked_extras")

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        super().__init__(path)
        self.manifest = manifest = read_manifest(self.path, FORMAT, (1, FORMAT_VERSION), _REWRITE)
        self._check_sizes(opened=False)
        if manifest["format_version"] == 1:
            self._chunk_bytes, self._sums = CHUNK_BYTES, legacy_chunks(self.path, manifest["files"], _DAMAGED)
            warnings.warn(f"token store {self.path} was written by an older cpdata (format_version 1, no chunk "
                          f"checksums): its {sum(e['bytes'] for e in manifest['files'].values())} bytes were hashed "
                          f"whole to open it; rewrite it once for an O(1) open: `cpdata pack-store {self.path} "
                          "--out NEW_DIR`", stacklevel=2)  # fmt: skip
        else:
            self._chunk_bytes = int(manifest["chunk_bytes"])
            if manifest.get("chunk_hash") != CHUNK_HASH:
                raise ValueError(f"{self.path / MANIFEST} records chunk checksums of kind {manifest.get('chunk_hash')!r}, this "
                                 f"cpdata checks {CHUNK_HASH!r}; {_REWRITE}")  # fmt: skip
            self._sums = {e["file"]: e["chunks"] for e in manifest["files"].values()}
        self.per_token_keys = frozenset(manifest["extras"])
        self._id_range = (0, -1 if manifest["max_id"] is None else manifest["max_id"])  # never negative
        self.labels_alignment: str | None = manifest.get("labels_alignment")
        """What the stored labels and masks are aligned with, when the writer declared it (``Tokenize``: inputs)."""
        self._digest = str(manifest[DIGEST_KEY])
        self._open()
        if verify:
            self.verify_content()

    def _checker(self, name: str, describe: Any, data: np.ndarray | None = None) -> ChunkChecker:
        size = next(e["bytes"] for e in self.manifest["files"].values() if e["file"] == name)
        itemsize = 1 if data is None else data.dtype.itemsize
        data = None if data is None else data.view(np.uint8)
        return ChunkChecker(self.path / name, self._sums[name], size, self._chunk_bytes, _DAMAGED, describe, data,
                            itemsize)  # fmt: skip

    def _open(self) -> None:
        n = self.manifest["tokens"]
        self._offsets = np.load(self.path / OFFSETS_FILE, mmap_mode="r", allow_pickle=False)
        self._tokens = self._map(TOKENS_FILE, self.manifest["dtype"], n)
        self._lengths: np.ndarray | None = None
        # the index files (8 B + 1 B per extra per document) are checked whole by a process's first read; a
        # document's token and extra bytes chunk by chunk, through the mappings the reads use
        self._check_index = [self._checker(OFFSETS_FILE, partial(self._listed, self._offsets.offset, 8, "offsets"))]
        self._check_tokens = self._checker(TOKENS_FILE, partial(self._stored, self._tokens.dtype.itemsize),
                                           self._tokens)  # fmt: skip
        self._checked_extras = {}  # key: (values, present, checker), what a read walks
        for key, dtype in self.manifest["extras"].items():
            values, present = self._map(f"{key}.bin", dtype, n), np.load(self.path / f"{key}.present.npy", mmap_mode="r")
            flags = partial(self._listed, present.offset, 1, "flags")
            self._check_index.append(self._checker(f"{key}.present.npy", flags))
            checker = self._checker(f"{key}.bin", partial(self._stored, values.dtype.itemsize), values)
            self._checked_extras[key] = (values, present, checker)

    def _map(self, name: str, dtype: str, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(self.path / name, dtype=np.dtype(dtype), mode="r", shape=(n,))

    def _checkers(self) -> list[ChunkChecker]:
        return [*self._check_index, self._check_tokens, *(c for _, _, c in self._checked_extras.values())]

    def verify_content(self) -> None:
        """Check every chunk of every file against the manifest (``precompute`` calls it); raises naming the file,
        byte range and documents."""
        for checker in self._checkers():
            checker.check_all()

    def _stored(self, width: int, lo: int, hi: int) -> str:
        """The documents whose elements (``width`` bytes each) lie in bytes ``[lo, hi)`` of a ``.bin`` file."""
        first = int(np.searchsorted(self._offsets, lo // width, side="right")) - 1
        last = int(np.searchsorted(self._offsets, -(-hi // width), side="left")) - 1
        return f"documents {max(first, 0)}..{min(max(last, first, 0), len(self) - 1)} are stored there"

    def _listed(self, at: int, width: int, what: str, lo: int, hi: int) -> str:
        """Which documents' entries of an index file (data at byte ``at``, ``width`` bytes each) lie there."""
        first, last = max(0, (lo - at) // width), max(0, (hi - at - 1) // width)
        return f"it holds the {what} of documents {first}..{min(last, len(self))}"

    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            for checker in self._check_index:
                checker.check_all()
            self._lengths = np.diff(self._offsets).astype(np.int64, copy=False)
        return self._lengths

    def __len__(self) -> int:
        return int(self.manifest["documents"])

    def _read(self, i: int) -> dict[str, np.ndarray]:
        # The checks' fast path, inlined: a read inside each file's checked span costs two comparisons per
        # file (cpdata.sources.chunksums). The tokens' span is empty until this process checked the index
        # files, so a process's first read (a forked worker's too) takes the slow path and checks them first.
        start, stop = int(self._offsets[i]), int(self._offsets[i + 1])
        lo, hi = self._check_tokens.span
        if start < lo or stop > hi:
            for checker in self._check_index:
                checker.check_all(i)
            start, stop = int(self._offsets[i]), int(self._offsets[i + 1])  # read again, now checked
            checker = self._check_tokens
            checker.check(start * checker.itemsize, stop * checker.itemsize, i)
        out = {"input_ids": self._tokens[start:stop].astype(np.int64)}
        for key, (values, present, checker) in self._checked_extras.items():
            if present[i]:
                lo, hi = checker.span
                if start < lo or stop > hi:
                    checker.check(start * checker.itemsize, stop * checker.itemsize, i)
                out[key] = np.array(values[start:stop])
        return out

    def fingerprint(self) -> str:
        """``token_store:`` + the manifest digest (covers every file's sha256 and chunk checksums)."""
        return f"token_store:{self._digest}"

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` if the store was rewritten or a file resized since it was opened (a few ``stat`` s)."""
        on_disk = json.loads((self.path / MANIFEST).read_bytes()).get(DIGEST_KEY)
        if on_disk != self._digest:
            raise ValueError(
                f"token store {self.path} was rewritten since it was opened (manifest digest {self._digest[:16]}… "
                f"then, {str(on_disk)[:16]}… now); a run trains on the store as opened: reopen it and start a new run"
            )
        self._check_sizes(opened=True)

    def _check_sizes(self, *, opened: bool) -> None:
        """Every file is there, of the size the manifest records (``opened``: since the store was opened)."""
        for entry in self.manifest["files"].values():
            file = self.path / entry["file"]
            if not file.is_file():
                what = ("was removed since the store was opened; restore it, or reopen the store and start a new run"
                        if opened else f"is missing (the manifest records {entry['bytes']} bytes); restore it, or "
                        f"{_REWRITE}")  # fmt: skip
                raise ValueError(f"token store file {file} {what}")
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise ValueError(f"token store file {file} has {size} bytes, the manifest records "
                                 f"{entry['bytes']}; {_REWRITE}")  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.check_unchanged()
        self._open()
