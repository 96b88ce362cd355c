"""Per-chunk content checksums of a token store's files: taken while writing, checked on first read.

Every file of a store is cut into chunks of ``CHUNK_BYTES`` (1 MiB) and each
chunk's 64-bit xxh3 is recorded in the manifest (``files.KEY.chunks``, 16 hex
digits each; ~19 bytes of JSON per MiB of data, 20 KB per GB). The manifest's
digest covers them, so a plan that records the digest names the bytes those
checksums describe.

A reader (:class:`ChunkChecker`, one per file and process) checks a chunk the
first time a read touches it and remembers it in a bytearray (1 byte per
chunk): the fast path of a read whose chunks are checked is two bytearray
lookups. A mismatch raises ``ValueError`` naming the file, the chunk's byte
range and the document being read.

Cost: xxh3 hashes ~9 GB/s on one core, so checking every byte once costs
~4 % of a single-process reading pass over a token store (``cpdata bench
--sections integrity``). Each process checks for itself: with ``W`` dataloader
workers reading interleaved documents every worker touches nearly every chunk,
so the first epoch pays up to ``W x`` that share per worker (persistent workers
pay it once per run). A chunk is checked once per process (a forked worker
forgets what its parent checked and checks again): bytes changed on disk
after that are not seen again (``check_unchanged`` still catches resized or
rewritten files at each epoch).
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CHUNK_BYTES", "CHUNK_HASH", "ChunkChecker", "ChunkHasher", "file_chunk_sums", "legacy_chunks"]

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


def file_chunk_sums(path: str | os.PathLike[str], chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """The chunk checksums of a file on disk (one pass, ``chunk_bytes`` at a time)."""
    sums = []
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk_bytes):
            sums.append(_digest(block))
    return sums


_LIVE: weakref.WeakSet[ChunkChecker] = weakref.WeakSet()
"""Every checker of this process: a forked child (a dataloader worker) forgets what its parent checked."""


def _forget_in_child() -> None:
    for checker in list(_LIVE):
        checker._done = bytearray(len(checker.sums))


os.register_at_fork(after_in_child=_forget_in_child)


class ChunkChecker:
    """Checks one store file's chunks against recorded checksums, each chunk once per process.

    Args:
        path: the file.
        sums: its chunk checksums (hex), from the manifest.
        size: its size in bytes, from the manifest.
        chunk_bytes: a power of two.
        fix: what the error tells the user to do.
        describe: ``f(lo, hi) -> str`` naming what the file holds in bytes ``[lo, hi)`` (the documents);
            the error quotes it. Not pickled.
        data: the file's bytes as a uint8 array when the reader maps it already (its pages are then faulted
            in once, for the read and the check alike); else the file is memory-mapped on the first check.
    """

    __slots__ = ("__weakref__", "_bytes", "_done", "_shift", "chunk_bytes", "describe", "fix", "path", "size", "sums")

    def __init__(
        self, path: Path, sums: list[str], size: int, chunk_bytes: int, fix: str,
        describe: Callable[[int, int], str] | None = None, data: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        if chunk_bytes < 1 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"{path}: chunk size {chunk_bytes} is not a power of two; {fix}")
        expected = -(-size // chunk_bytes)
        if len(sums) != expected:
            raise ValueError(f"{path}: the manifest records {len(sums)} chunk checksums for {size} bytes "
                             f"({expected} chunks of {chunk_bytes}); {fix}")  # fmt: skip
        self.path, self.sums, self.size, self.chunk_bytes, self.fix = path, sums, size, chunk_bytes, fix
        self.describe = describe
        self._shift = chunk_bytes.bit_length() - 1
        self._done = bytearray(len(sums))
        self._bytes = data
        _LIVE.add(self)

    def __getstate__(self) -> dict[str, object]:  # a fresh process checks for itself
        return {k: getattr(self, k) for k in ("path", "sums", "size", "chunk_bytes", "fix")}

    def __setstate__(self, state: dict[str, object]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._shift = self.chunk_bytes.bit_length() - 1
        self._done = bytearray(len(self.sums))
        self._bytes, self.describe = None, None
        _LIVE.add(self)

    @property
    def checked(self) -> int:
        """Chunks checked so far in this process."""
        return len(self._done) - self._done.count(0)

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

    def check_all(self, document: int | None = None) -> None:
        """Check every chunk of the file (what ``verify=True`` and ``precompute`` do)."""
        for c in range(len(self.sums)):
            if not self._done[c]:
                self._check_chunk(c, document)

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
        self._done[c] = 1


def legacy_chunks(path: Path, files: dict[str, Any], fix: str) -> dict[str, list[str]]:
    """A format 1 store: every file hashed whole against its recorded sha256, chunk checksums derived on the way."""
    import xxhash

    sums: dict[str, list[str]] = {}
    for entry in files.values():
        file, sha, chunks = path / entry["file"], hashlib.sha256(), []
        with open(file, "rb", buffering=0) as f:
            while block := f.read(CHUNK_BYTES):
                sha.update(block)
                chunks.append(format(xxhash.xxh3_64_intdigest(block), "016x"))
        if sha.hexdigest() != entry["sha256"]:
            raise ValueError(f"token store file {file} is corrupted (sha256 differs from the manifest); {fix}")
        sums[entry["file"]] = chunks
    return sums
