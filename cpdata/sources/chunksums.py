"""Per-chunk content checksums of a token store's files: taken while writing, checked on first read.

Each file is cut into ``CHUNK_BYTES`` (1 MiB) chunks whose 64-bit xxh3 the manifest records (20 KB of JSON
per GB); the manifest digest covers them. A :class:`ChunkChecker` (one per file and process) checks a chunk
the first time a read touches it; a read inside the checked ``span`` costs two comparisons. Each process
(each forked worker) checks for itself; bytes changed after a chunk was checked are not seen again
(``check_unchanged`` still catches resized or rewritten files). Costs: docs/benchmarks.md (``integrity``).
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CHUNK_BYTES", "CHUNK_HASH", "ChunkChecker", "ChunkHasher", "file_sums", "legacy_chunks"]

CHUNK_BYTES = 1 << 20
"""Bytes per checksummed chunk (a power of two; the last chunk of a file may be shorter)."""
CHUNK_HASH = "xxh3_64"
"""The manifest's name for the chunk checksum."""


def _digest(data: object) -> str:
    import xxhash

    return format(xxhash.xxh3_64_intdigest(data), "016x")


class ChunkHasher:
    """Checksums of a byte stream, chunk by chunk, as it is written (``update`` then ``finish``)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        import xxhash

        self.chunk_bytes = chunk_bytes
        self.sums: list[str] = []
        self._new = xxhash.xxh3_64
        self._hash = self._new()
        self._filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, self.chunk_bytes - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self.sums.append(format(self._hash.intdigest(), "016x"))
                self._hash, self._filled = self._new(), 0

    def finish(self) -> list[str]:
        """The checksums, the last (short) chunk included."""
        if self._filled:
            self.sums.append(format(self._hash.intdigest(), "016x"))
            self._hash, self._filled = self._new(), 0
        return self.sums


def file_sums(path: str | os.PathLike[str]) -> tuple[str, list[str]]:
    """``(sha256, chunk checksums)`` of a file on disk, in one pass (the one reader of a file's sha256)."""
    sha, sums = hashlib.sha256(), []
    with open(path, "rb", buffering=0) as f:
        while block := f.read(CHUNK_BYTES):
            sha.update(block)
            sums.append(_digest(block))
    return sha.hexdigest(), sums


_LIVE: weakref.WeakSet[ChunkChecker] = weakref.WeakSet()
"""Every checker of this process: a forked child (a dataloader worker) forgets what its parent checked."""

_REACH = 4096
"""How many chunks either side of a newly checked one the checked span looks for neighbours (a bounded scan)."""


def _forget_in_child() -> None:
    for checker in list(_LIVE):
        checker._forget()


os.register_at_fork(after_in_child=_forget_in_child)


class ChunkChecker:
    """Checks one store file's chunks against recorded checksums, each chunk once per process.

    ``span`` is ``(lo, hi)``: elements (``itemsize`` bytes each) ``[lo, hi)`` lie in checked chunks (the run around
    the chunk checked last; the whole file once all are), one tuple replaced whole so threads never see half an
    update. ``describe(lo, hi)`` names the documents stored in bytes ``[lo, hi)`` for the error (not pickled);
    ``data`` is the reader's own mapping of the file, so pages fault once for the read and the check alike."""

    __slots__ = ("__weakref__", "_bytes", "_done", "_left", "_shift", "chunk_bytes", "describe", "fix", "itemsize",
                 "path", "size", "span", "sums")  # fmt: skip

    def __init__(
        self, path: Path, sums: list[str], size: int, chunk_bytes: int, fix: str,
        describe: Callable[[int, int], str] | None = None, data: np.ndarray | None = None, itemsize: int = 1,
    ) -> None:  # fmt: skip
        if chunk_bytes < 1 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"{path}: chunk size {chunk_bytes} is not a power of two; {fix}")
        expected = -(-size // chunk_bytes)
        if len(sums) != expected:
            raise ValueError(f"{path}: the manifest records {len(sums)} chunk checksums for {size} bytes "
                             f"({expected} chunks of {chunk_bytes}); {fix}")  # fmt: skip
        self.path, self.sums, self.size, self.chunk_bytes, self.fix = path, sums, size, chunk_bytes, fix
        self.describe, self.itemsize, self._bytes = describe, itemsize, data
        self._shift = chunk_bytes.bit_length() - 1
        self._forget()
        _LIVE.add(self)

    def __reduce__(self) -> tuple[Any, ...]:  # a fresh process checks for itself, through its own mapping
        return ChunkChecker, (self.path, self.sums, self.size, self.chunk_bytes, self.fix, None, None, self.itemsize)

    def _forget(self) -> None:
        """Nothing checked (a new process): the checked span is empty."""
        self._done = bytearray(len(self.sums))
        self._left = len(self.sums)
        self.span = (1, 0)  # no element, not even an empty read at 0

    @property
    def checked(self) -> int:
        """Chunks checked so far in this process."""
        return len(self.sums) - self._left

    def check(self, lo: int, hi: int, document: int | None) -> None:
        """Check every chunk overlapping bytes ``[lo, hi)`` not checked yet (``document``: the one being read)."""
        if hi <= lo:
            return
        first, last = lo >> self._shift, (hi - 1) >> self._shift
        done = self._done
        if done[first] and done[last] and last - first < 2:
            return
        for c in range(first, last + 1):
            if not done[c]:
                self._check_chunk(c, document)

    @property
    def complete(self) -> bool:
        """Every chunk checked in this process."""
        return not self._left

    def check_all(self, document: int | None = None) -> None:
        """Check every chunk of the file (what ``verify=True`` and ``precompute`` do)."""
        if self._left:
            self.check(0, self.size, document)

    def _check_chunk(self, c: int, document: int | None) -> None:
        if self._bytes is None:
            self._bytes = np.memmap(self.path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        lo, hi = c * self.chunk_bytes, min((c + 1) * self.chunk_bytes, self.size)
        if _digest(self._bytes[lo:hi]) != self.sums[c]:
            who = "checking the whole file" if document is None else f"while reading document {document}"
            if self.describe is not None:
                who += f"; {self.describe(lo, hi)}"
            raise ValueError(
                f"token store file {self.path} bytes {lo}..{hi} (chunk {c} of {len(self.sums)}) do not match the "
                f"checksum recorded when the store was written ({who}): the file was edited or damaged on disk "
                f"after it was written; {self.fix}"
            )
        done = self._done
        done[c] = 1
        self._left -= 1
        if self._left:  # the run of checked chunks around c, looked for within _REACH chunks
            start, stop = max(0, c - _REACH), min(len(done), c + 1 + _REACH)
            first = done.rfind(0, start, c) + 1 or start
            end = done.find(0, c + 1, stop)
            lo, hi = first * self.chunk_bytes, min((stop if end < 0 else end) * self.chunk_bytes, self.size)
        else:
            lo, hi = 0, self.size
        self.span = (-(-lo // self.itemsize), hi // self.itemsize)


def legacy_chunks(path: Path, files: dict[str, Any], fix: str) -> dict[str, list[str]]:
    """A format 1 store: every file hashed whole against its recorded sha256, chunk checksums derived on the way."""
    sums: dict[str, list[str]] = {}
    for entry in files.values():
        sha, sums[entry["file"]] = file_sums(path / entry["file"])
        if sha != entry["sha256"]:
            raise ValueError(f"token store file {path / entry['file']} is corrupted (sha256 differs from the "
                             f"manifest); {fix}")  # fmt: skip
    return sums
