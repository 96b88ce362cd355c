"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, as megatron-core's ``IndexedDatasetBuilder``
writes them) read in place: numpy only, memory-mapped, O(1) open.

``PREFIX.idx``, little-endian: 9 B magic ``MMIDIDX\\x00\\x00``, u64 version 1, u8 dtype code
(:data:`DTYPES`), u64 ``S`` sequences, u64 ``D`` document indices; then int32 ``[S]`` tokens per sequence,
int64 ``[S]`` byte offsets into ``PREFIX.bin``, int64 ``[D]`` document indices (document ``d`` is sequences
``doc_idx[d]:doc_idx[d + 1]``) and, in multimodal builds, int8 ``[S]`` modes. ``PREFIX.bin`` holds every
sequence's tokens back to back.

A cpdata document is a Megatron document, its sequences concatenated (``unit="documents"``); with
``unit="sequences"`` every sequence (sentence) is one. Opening checks the header and both files' sizes;
``lengths`` checks the index (O(n)); a read checks its own rows. The format holds no checksums: an in-place
edit of the ``.bin`` that keeps its size and misses the fingerprint's sampled blocks goes unnoticed (a token
store, ``cpdata tokenize --format cpdata``, checksums every chunk). Costs: docs/benchmarks.md.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.sources.base import TokenizedDataset, _check_ids
from cpdata.sources.fingerprint import sample_positions

__all__ = ["DTYPES", "MAGIC", "UNITS", "MegatronIndexed", "is_megatron_prefix", "megatron_paths"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
DTYPES: dict[int, np.dtype] = {
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}  # fmt: skip
"""megatron-core's ``DType`` codes."""
UNITS: tuple[str, ...] = ("documents", "sequences")
_SAMPLES, _BLOCK, _CHUNK = 64, 4096, 1 << 22
_LEGACY = b"TNTIDX\x00\x00"
_FIX = "re-run Megatron's preprocess_data.py (or `cpdata tokenize --format megatron`) to rewrite both files"


def megatron_paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(PREFIX.bin, PREFIX.idx)``; a path ending in ``.bin`` or ``.idx`` names its prefix."""
    p = Path(prefix)
    if p.suffix in (".bin", ".idx"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".bin"), p.with_name(p.name + ".idx")


def is_megatron_prefix(path: str | os.PathLike[str]) -> bool:
    """``path`` is ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` and one of the pair exists (the reader names a
    missing other half)."""
    p = Path(path)
    if p.is_dir() or not (p.suffix in (".bin", ".idx") or not p.exists()):
        return False
    return any(q.is_file() for q in megatron_paths(p))


class MegatronIndexed(TokenizedDataset):
    """A Megatron ``.bin``/``.idx`` pair at ``prefix`` as a :class:`~cpdata.sources.base.TokenizedDataset`
    (``unit``: see the module docstring); ``dtype``, ``sequences``, ``documents`` and ``multimodal`` are what
    the index declares."""

    kind = "megatron"
    _transient = ("_seq_lengths", "_pointers", "_doc_idx", "_modes", "_tokens", "_offsets", "_lengths")

    def __init__(self, prefix: str | os.PathLike[str], *, unit: str = "documents") -> None:
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}")
        self.bin_path, self.idx_path = megatron_paths(prefix)
        super().__init__(self.bin_path.with_suffix(""))
        self.unit = unit
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise ValueError(f"Megatron dataset {self.path}: {p} does not exist; a Megatron indexed dataset is "
                                 f"PREFIX.bin and PREFIX.idx side by side: pass the prefix both share")  # fmt: skip
        self._opened = self._stats()
        self._read_header()
        self._digest: str | None = None
        self._open()
        self._sampled = self._sample_digest()

    def _stats(self) -> tuple[int, int, int, int]:
        a, b = os.stat(self.idx_path), os.stat(self.bin_path)
        return (a.st_size, a.st_mtime_ns, b.st_size, b.st_mtime_ns)

    def _read_header(self) -> None:
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if head[:9] != MAGIC:
            legacy = " (the legacy non-mmap 'TNTIDX' index of old fairseq/Megatron)" if head[:8] == _LEGACY else ""
            raise ValueError(f"{self.idx_path} is not a Megatron indexed-dataset index{legacy}: it starts with "
                             f"{head[:9]!r}, expected {MAGIC!r}; {_FIX}")  # fmt: skip
        if len(head) < HEADER_BYTES:
            raise ValueError(f"{self.idx_path} is truncated: {len(head)} bytes, the header alone is {HEADER_BYTES}; {_FIX}")
        version, code, sequences, indices = struct.unpack("<QBQQ", head[9:])
        if version != VERSION:
            raise ValueError(f"{self.idx_path} has index version {version}; megatron-core and cpdata read version "
                             f"{VERSION}; {_FIX}")  # fmt: skip
        if code not in DTYPES:
            raise ValueError(f"{self.idx_path} declares dtype code {code}, not one of megatron-core's "
                             f"{ {k: v.name for k, v in DTYPES.items()} }; {_FIX}")  # fmt: skip
        self.dtype, self.sequences, self.documents = DTYPES[code], int(sequences), int(indices) - 1
        base = HEADER_BYTES + 12 * self.sequences + 8 * int(indices)
        size = self._opened[0]
        if indices < 1 or size not in (base, base + self.sequences):
            raise ValueError(
                f"{self.idx_path} has {size} bytes, but its header's counts ({self.sequences} sequences, "
                f"{int(indices)} document indices) need {base} (or {base + self.sequences} with modes): the index is "
                f"truncated or its header damaged; {_FIX}"
            )
        self.multimodal = size == base + self.sequences

    def _open(self) -> None:
        s, isz = self.sequences, self.dtype.itemsize
        idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self._seq_lengths = np.frombuffer(idx, dtype="<i4", count=s, offset=HEADER_BYTES)
        self._pointers = np.frombuffer(idx, dtype="<i8", count=s, offset=HEADER_BYTES + 4 * s)
        self._doc_idx = np.frombuffer(idx, dtype="<i8", count=self.documents + 1, offset=HEADER_BYTES + 12 * s)
        self._modes = (np.frombuffer(idx, dtype="i1", count=s, offset=HEADER_BYTES + 12 * s + 8 * (self.documents + 1))
                       if self.multimodal else None)  # fmt: skip
        if int(self._doc_idx[0]) != 0 or int(self._doc_idx[-1]) != s:
            raise ValueError(f"{self.idx_path}: document indices run {int(self._doc_idx[0])}..{int(self._doc_idx[-1])},"
                             f" a Megatron index's run 0..{s} (its sequence count); the index is damaged; {_FIX}")  # fmt: skip
        end = int(self._pointers[-1]) + int(self._seq_lengths[-1]) * isz if s else 0
        size = self._opened[2]
        if size != end:
            what = ("truncated (cut short, e.g. by an interrupted copy)" if size < end else
                    "longer than its index: the .idx belongs to another .bin, or the .bin was appended to")  # fmt: skip
            raise ValueError(f"{self.bin_path} has {size} bytes but {self.idx_path} says its last sequence ends at "
                             f"byte {end}: the .bin is {what}; copy both files again from the same build, or {_FIX}")  # fmt: skip
        # a plain ndarray over the map: slicing an np.memmap pays subclass bookkeeping on every read
        self._tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r").view(np.ndarray) if size else
                        np.zeros(0, self.dtype))  # fmt: skip
        self._offsets: np.ndarray | None = None
        self._lengths: np.ndarray | None = None

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[documents]`` (or ``[sequences]``), from the index; the index is checked on the way (O(n))."""
        if self._lengths is None:
            self._check_index()  # sequences lie back to back: each starts where the one before ends
            starts = np.append(self._pointers // self.dtype.itemsize, self._opened[2] // self.dtype.itemsize)
            self._offsets = starts if self.unit == "sequences" else starts[self._doc_idx]
            self._lengths = np.diff(self._offsets)
        return self._lengths

    def _check_index(self) -> None:
        isz, s = self.dtype.itemsize, self.sequences
        for lo in range(0, s, _CHUNK):
            hi = min(s, lo + _CHUNK + 1)
            lengths, pointers = self._seq_lengths[lo:hi].astype(np.int64), self._pointers[lo:hi]
            bad = np.flatnonzero((lengths < 0) | (pointers % isz != 0))
            if bad.size:
                self._bad_sequence(lo + int(bad[0]))
            gaps = np.flatnonzero(np.diff(pointers) != lengths[:-1] * isz)
            if gaps.size:
                self._bad_sequence(lo + 1 + int(gaps[0]))
        if self.documents and np.any(np.diff(self._doc_idx) < 0):
            d = int(np.flatnonzero(np.diff(self._doc_idx) < 0)[0])
            raise ValueError(f"{self.idx_path}: document {d} ends at sequence {int(self._doc_idx[d + 1])}, before it "
                             f"starts ({int(self._doc_idx[d])}); the index is damaged; {_FIX}")  # fmt: skip
        if self._modes is not None and np.any(self._modes):
            self._bad_mode(int(np.flatnonzero(self._modes)[0]))

    def _bad_sequence(self, j: int) -> None:
        raise ValueError(
            f"{self.idx_path}: sequence {j} (length {int(self._seq_lengths[j])}, byte offset {int(self._pointers[j])})"
            " does not follow the one before it back to back in the .bin, as megatron-core's builder writes them; "
            f"the index is damaged or was written by another tool; {_FIX}"
        )

    def _bad_mode(self, j: int) -> None:
        raise ValueError(f"{self.idx_path}: sequence {j} has mode {int(self._modes[j])} (a multimodal build's "  # type: ignore[index]
                         "non-text item); cpdata reads token ids only: build a text-only dataset")  # fmt: skip

    def __len__(self) -> int:
        return self.sequences if self.unit == "sequences" else self.documents

    def _span(self, i: int) -> tuple[int, int]:
        """Document ``i``'s tokens ``[start, stop)`` in the ``.bin``, its index rows checked."""
        if self._offsets is not None:
            start, stop = self._offsets[i : i + 2].tolist()
            return start, stop
        s0, s1 = (i, i + 1) if self.unit == "sequences" else (int(self._doc_idx[i]), int(self._doc_idx[i + 1]))
        if s1 < s0 or s1 > self.sequences:
            raise ValueError(f"{self.idx_path}: document {i} spans sequences {s0}..{s1}; the index is damaged; {_FIX}")
        if s1 == s0:
            return 0, 0
        isz = self.dtype.itemsize
        lo, hi = max(s0 - 1, 0), min(s1 + 1, self.sequences)  # with the neighbours: the document is where they say
        lengths, pointers = self._seq_lengths[lo:hi].tolist(), self._pointers[lo:hi].tolist()  # a few rows: lists
        for j in range(hi - lo):
            if lengths[j] < 0 or pointers[j] % isz or (j and pointers[j] != pointers[j - 1] + lengths[j - 1] * isz):
                self._bad_sequence(lo + j)
        if self._modes is not None and self._modes[s0:s1].any():
            self._bad_mode(s0 + int(np.flatnonzero(self._modes[s0:s1])[0]))
        start = pointers[s0 - lo] // isz
        stop = start + sum(lengths[s0 - lo : s1 - lo])
        if stop > self._tokens.shape[0]:
            self._bad_sequence(s1 - 1)
        return start, stop

    def _read(self, i: int) -> dict[str, np.ndarray]:
        start, stop = self._span(i)
        raw = self._tokens[start:stop]
        ids = raw.astype(np.int64)
        if raw.dtype.kind == "f" and not np.array_equal(ids, raw):
            j = int(np.flatnonzero(ids != raw)[0])
            raise ValueError(f"{self.bin_path}: document {i} holds {float(raw[j])!r} at position {j}; token ids are "
                             f"whole numbers (this index declares {self.dtype.name}): rebuild with an integer dtype")  # fmt: skip
        return {"input_ids": ids}

    def check_token_ids(self, vocab_size: int | None = None) -> None:
        """Scan the ``.bin`` in 4M-token chunks (~1 GB/s); reads a document only to name a culprit."""
        if self.dtype.kind == "u" and vocab_size is None:
            return  # unsigned integers are valid ids
        self.lengths  # noqa: B018 (checks the index, and sets the documents' token offsets)
        offsets = self._offsets
        assert offsets is not None
        for lo in range(0, self._tokens.shape[0], _CHUNK):
            chunk = self._tokens[lo : lo + _CHUNK]
            ints = chunk.astype(np.int64)
            bad = (ints < 0) | (ints != chunk) if chunk.dtype.kind == "f" else ints < 0
            if vocab_size is not None:
                bad |= ints >= vocab_size
            if bad.any():
                doc = int(np.searchsorted(offsets, lo + int(np.flatnonzero(bad)[0]), side="right")) - 1
                _check_ids(self.path, doc, self._read(doc)["input_ids"], vocab_size)

    def _samples(self, path: Path, size: int, h: Any) -> None:
        """Feed ``h`` the size and 64 evenly spaced 4 KiB blocks (first and last included) of ``path``."""
        h.update(f"|{size}|".encode())
        with open(path, "rb") as f:
            for k in sample_positions(max(1, -(-size // _BLOCK)), _SAMPLES):
                f.seek(k * _BLOCK)
                h.update(f.read(_BLOCK))

    def _sample_digest(self) -> str:
        """Both files' sizes and sampled blocks: O(1), taken at open, compared when an mtime moved."""
        h = hashlib.blake2b(digest_size=16)
        self._samples(self.idx_path, self._opened[0], h)
        self._samples(self.bin_path, self._opened[2], h)
        return h.hexdigest()

    def fingerprint(self) -> str:
        """``megatron:`` + the sha256 of the whole ``.idx``, the ``.bin``'s size and 64 sampled blocks (computed
        once, O(index))."""
        if self._digest is None:
            h = hashlib.sha256(f"megatron:{self.unit}:".encode())
            with open(self.idx_path, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
            self._samples(self.bin_path, self._opened[2], h)
            self._digest = h.hexdigest()
        return f"megatron:{self._digest}"

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` if either file was resized, or rewritten with other content, since opening."""
        now = self._stats()
        if now == self._opened:
            return
        for name, path, k in (("index", self.idx_path, 0), ("data", self.bin_path, 2)):
            if now[k] != self._opened[k]:
                raise ValueError(f"Megatron {name} file {path} changed since it was opened ({self._opened[k]} -> "
                                 f"{now[k]} bytes); a run trains on the dataset as opened: restore it, or reopen it "
                                 "with open_dataset() and start a new run")  # fmt: skip
        if self._sample_digest() != self._sampled:
            raise ValueError(f"Megatron dataset {self.path} was rewritten since it was opened (same sizes, other "
                             "content); restore it, or reopen it with open_dataset() and start a new run")  # fmt: skip
        self._opened = now

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.check_unchanged()
        self._open()

    def __repr__(self) -> str:
        return (f"MegatronIndexed({str(self.path)!r}, {self.unit}={len(self)}, dtype={self.dtype.name}, "
                f"sequences={self.sequences})")  # fmt: skip
