"""Readers of plain files: a lengths array, JSONL rows, a folder of ``.npy`` token arrays.

A lengths file is enough to plan, not to serve. JSONL is scanned once at open (each row's byte offset,
length and CRC-32, the file's sha256 on the way); a read is one positional ``pread`` through a handle each
process opens for itself (keyed on its pid: an inherited handle shares its offset), so readers are
picklable and safe from threads and forked or spawned workers. ``.npy`` files are opened per read.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from array import array
from collections.abc import Callable
from typing import BinaryIO

import numpy as np

from cpdata.sources.base import TokenizedDataset, json_row, token_row
from cpdata.sources.chunksums import file_sums
from cpdata.sources.fingerprint import lengths_sha256, sample_positions

__all__ = ["JsonlDocuments", "LengthsFile", "NpyFolder"]

_FILE_SAMPLES = 64
"""Rows (JSONL) or files (folder) re-checked at an epoch start when the data's mtime moved."""


_OPEN_LOCK = threading.Lock()
"""Serialises opening a reader's per-process file handle (a fresh lock in a forked child)."""

def _fresh_open_lock() -> None:
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()  # a lock held by another thread at fork time would stay held in the child


os.register_at_fork(after_in_child=_fresh_open_lock)


class LengthsFile(TokenizedDataset):
    """Document lengths only: a 1-D integer ``.npy`` (memory-mapped) or a ``.npz``
    holding a ``lengths`` array (or exactly one array). Enough to plan, not to serve."""

    kind = "lengths"
    serves_tokens = False

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        st = os.stat(self.path)
        self._opened = (st.st_size, st.st_mtime_ns)
        if self.path.suffix == ".npz":
            with np.load(self.path) as z:
                key = "lengths" if "lengths" in z.files else (z.files[0] if len(z.files) == 1 else None)
                if key is None:
                    raise ValueError(
                        f"{self.path} holds arrays {z.files}; name the lengths array 'lengths' "
                        "or save exactly one array"
                    )
                raw = z[key]
        else:
            raw = np.load(self.path, mmap_mode="r")
        if raw.ndim != 1 or raw.dtype.kind not in "iu":
            raise ValueError(
                f"{self.path} must hold a 1-D integer array of document lengths, got dtype={raw.dtype} "
                f"shape={raw.shape}"
            )
        self._lengths = raw if raw.dtype == np.int64 else raw.astype(np.int64)
        if self._lengths.size and int(self._lengths.min()) < 0:
            bad = int(np.argmin(self._lengths))
            raise ValueError(f"{self.path}: document {bad} has negative length {int(self._lengths[bad])}")
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """``lengths:`` + the sha256 of the lengths (computed once)."""
        if self._fingerprint is None:
            self._fingerprint = f"lengths:{lengths_sha256(self._lengths)}"
        return self._fingerprint

    def check_unchanged(self) -> None:
        st = os.stat(self.path)
        if (st.st_size, st.st_mtime_ns) != self._opened:
            raise ValueError(
                f"{self.path} changed since it was opened (size {self._opened[0]} -> {st.st_size} bytes, modified "
                "again); restore it, or reopen it and start a new run"
            )

    def _read(self, i: int) -> dict[str, np.ndarray]:
        raise ValueError(
            f"{self.path} holds document lengths only and cannot serve tokens (document {i}); "
            "serve the plan with the tokenized dataset (a .jsonl file or a folder of .npy token arrays)"
        )


class JsonlDocuments(TokenizedDataset):
    """One JSON object per line: ``{"input_ids": [...], "labels"?: [...], "loss_mask"?: [...]}``; whitespace-only
    lines are not documents. 20 B per document in memory (offset, length, CRC-32)."""

    kind = "jsonl"
    _transient = ("_file",)

    def __init__(self, path: str | os.PathLike[str], *, on_progress: Callable[[int], None] | None = None) -> None:
        super().__init__(path)
        offsets, lengths, crcs = array("q"), array("q"), array("I")
        h = hashlib.sha256()
        pos = 0
        low, high = int(np.iinfo(np.int64).max), -1  # the smallest and largest id seen
        keys: set[str] = set()
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                h.update(line)
                if line.strip():
                    offsets.append(pos)
                    crcs.append(zlib.crc32(line))
                    row = token_row(json_row(line, self.path, lineno, pos), f"{self.path} line {lineno}")
                    ids = row["input_ids"]
                    lengths.append(ids.shape[0])
                    keys.update(row)
                    if ids.shape[0]:
                        low, high = min(low, int(ids.min())), max(high, int(ids.max()))
                pos += len(line)
                if on_progress is not None:
                    on_progress(len(line))
            self._opened = (pos, os.fstat(f.fileno()).st_mtime_ns)  # bytes scanned, mtime when the scan ended
        offsets.append(pos)  # row i is bytes offsets[i]:offsets[i + 1] (with the newline, the blank lines after it)
        self._crcs, self._offsets = np.frombuffer(crcs, dtype=np.uint32), np.frombuffer(offsets, dtype=np.int64)
        self._lengths = np.frombuffer(lengths, dtype=np.int64)
        self._id_range = (low, high)  # the scan saw every id
        self._sha256 = h.hexdigest()
        self.per_token_keys = frozenset(keys - {"input_ids"})
        self._file: tuple[int, BinaryIO] | None = None  # (pid, handle) of the process that opened it

    def fingerprint(self) -> str:
        """``jsonl:`` + the file's sha256 (computed while scanning)."""
        return f"jsonl:{self._sha256}"

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` if the file grew, shrank, or (mtime moved) a sampled row changed since opening."""
        size, mtime = self._opened
        st = os.stat(self.path)
        if st.st_size != size:
            what = "rows were appended" if st.st_size > size else "it was cut short"
            raise ValueError(
                f"{self.path} changed since it was opened: {size} bytes then, {st.st_size} now ({what}); the "
                "dataset of a run is the file as opened: restore the original file, or reopen it with "
                "open_dataset() and start a new run on the new data"
            )
        if st.st_mtime_ns != mtime:
            for i in sample_positions(len(self), _FILE_SAMPLES):
                self._raw_row(i)  # raises naming the first sampled document that changed
            self._opened = (size, st.st_mtime_ns)  # touched, same bytes where sampled

    def _handle(self) -> BinaryIO:
        """This process's own handle, opened on first use and again after a fork or unpickling."""
        pid, opened = os.getpid(), self._file
        if opened is None or opened[0] != pid:
            with _OPEN_LOCK:  # threads opening at once would each replace (and so close) the other's handle
                opened = self._file
                if opened is None or opened[0] != pid:
                    opened = self._file = (pid, open(self.path, "rb", buffering=0))
        return opened[1]

    def _raw_row(self, i: int) -> bytes:
        """Row ``i``'s bytes (one ``pread``), checked against the CRC-32 taken when the file was opened."""
        offset, end = self._offsets[i : i + 2].tolist()
        handle = self._handle()  # held for the read: a handle dropped mid-call would close its descriptor
        chunk = os.pread(handle.fileno(), end - offset, offset)
        newline = chunk.find(b"\n")
        line = chunk if newline < 0 else chunk[: newline + 1]
        if zlib.crc32(line) != int(self._crcs[i]):
            raise ValueError(
                f"{self.path}: document {i} (byte offset {offset}) changed since the file was opened: its bytes "
                "differ from the ones read when the run planned it (the file was edited in place); restore the "
                "original file, or reopen it with open_dataset() and start a new run"
            )
        return line

    def _read(self, i: int) -> dict[str, np.ndarray]:
        row = json_row(self._raw_row(i), self.path, f"of document {i}", int(self._offsets[i]))
        return token_row(row, f"{self.path} line of document {i}")

    def __del__(self) -> None:
        opened = getattr(self, "_file", None)
        if opened is not None:
            opened[1].close()


class NpyFolder(TokenizedDataset):
    """A folder of ``.npy`` token arrays, one 1-D integer document per file, in file-name order; opening reads
    only each file's header."""

    kind = "npy_folder"

    def __init__(self, path: str | os.PathLike[str], *, on_progress: Callable[[int], None] | None = None) -> None:
        super().__init__(path)
        self._files = sorted(p.name for p in self.path.iterdir() if p.suffix == ".npy" and p.is_file())
        if not self._files:
            raise ValueError(f"{self.path} contains no .npy files; save one 1-D token array per document")
        self._lengths = np.empty(len(self._files), dtype=np.int64)
        self._stats = np.empty((len(self._files), 2), dtype=np.int64)  # size, mtime_ns of each file at open
        self._dir_mtime = os.stat(self.path).st_mtime_ns
        for i, name in enumerate(self._files):
            st = os.stat(self.path / name)
            self._stats[i] = (st.st_size, st.st_mtime_ns)
            arr = np.load(self.path / name, mmap_mode="r")
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(
                    f"{self.path / name}: expected a 1-D integer token array, got dtype={arr.dtype} "
                    f"shape={arr.shape}"
                )
            self._lengths[i] = arr.shape[0]
            if on_progress is not None:
                on_progress(1)
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """``npy_folder:`` + the sha256 of every file's name, size and bytes, in order (a rename or reorder
        changes it): O(bytes), once."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for name in self._files:
                h.update(f"{name}\0{(self.path / name).stat().st_size}\0{file_sums(self.path / name)[0]}\0".encode())
            self._fingerprint = f"npy_folder:{h.hexdigest()}"
        return self._fingerprint

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` if ``.npy`` files were added or removed, or a sampled file changed, since opening."""
        if os.stat(self.path).st_mtime_ns != self._dir_mtime:
            now = sorted(p.name for p in self.path.iterdir() if p.suffix == ".npy" and p.is_file())
            if now != self._files:
                added, removed = sorted(set(now) - set(self._files)), sorted(set(self._files) - set(now))
                raise ValueError(
                    f"{self.path} changed since it was opened: .npy files added {added[:5]}, removed {removed[:5]}; "
                    "the dataset of a run is the folder as opened: restore it, or reopen it with open_dataset() "
                    "and start a new run"
                )
        for i in sample_positions(len(self._files), _FILE_SAMPLES):
            self._check_file(i)

    def _check_file(self, i: int) -> None:
        st = os.stat(self.path / self._files[i])
        if (st.st_size, st.st_mtime_ns) != tuple(self._stats[i].tolist()):
            raise ValueError(
                f"{self.path / self._files[i]} (document {i}) changed since the folder was opened (size "
                f"{int(self._stats[i, 0])} -> {st.st_size} bytes, modified again); restore the original file, or "
                "reopen the folder with open_dataset() and start a new run"
            )

    def _read(self, i: int) -> dict[str, np.ndarray]:
        self._check_file(i)
        return {"input_ids": np.array(np.load(self.path / self._files[i], mmap_mode="r"), dtype=np.int64)}
