"""Writing a token store (:mod:`cpdata.sources.tokenstore`): append documents, then the index and manifest.

Memory stays at one document plus 8 B per document; each file is hashed as it is written (sha256 and 1 MiB
chunk xxh3, :mod:`cpdata.sources.chunksums`).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.sources.base import _written_ids
from cpdata.sources.chunksums import CHUNK_BYTES, CHUNK_HASH, ChunkHasher
from cpdata.sources.manifest import write_manifest

__all__ = ["FORMAT", "FORMAT_VERSION", "TOKENS_FILE", "TokenStoreWriter"]

FORMAT = "cpdata.tokens"
FORMAT_VERSION = 2
"""2: per-file chunk checksums; 1 (read, hashed whole at open): sha256 per file only."""
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"


class _HashedFile:
    """An append-only file that hashes what it writes (``np.save`` writes through it too)."""

    def __init__(self, path: Path) -> None:
        self.path, self.file, self.sha, self.size = path, open(path, "wb"), hashlib.sha256(), 0  # noqa: SIM115
        self.chunks = ChunkHasher()

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.sha.update(data)
        self.chunks.update(data)
        self.size += len(data)

    def close(self) -> dict[str, Any]:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"file": self.path.name, "bytes": self.size, "sha256": self.sha.hexdigest(),
                "chunks": self.chunks.finish()}  # fmt: skip


def _saved(path: Path, array: np.ndarray) -> dict[str, Any]:
    """``np.save`` ``array`` at ``path``, hashed as it is written; returns its manifest entry."""
    file = _HashedFile(path)
    np.save(file, array, allow_pickle=False)  # type: ignore[arg-type]
    return file.close()


class TokenStoreWriter:
    """Append documents to a store being written in the empty ``directory`` (normally an atomic temp directory);
    ``vocab_size <= 65536`` stores uint16, else uint32; ``name`` is what errors call the store."""

    def __init__(self, directory: str | os.PathLike[str], *, vocab_size: int | None = None, name: str | None = None) -> None:
        self.directory = Path(directory)
        self.name = Path(name) if name is not None else self.directory
        self.vocab_size = vocab_size
        self.dtype = np.dtype("<u2") if vocab_size is not None and vocab_size <= 1 << 16 else np.dtype("<u4")
        self.limit = vocab_size if vocab_size is not None else 1 << 32
        self._tokens = _HashedFile(self.directory / TOKENS_FILE)
        self._offsets = array("q", [0])
        self._extras: dict[str, tuple[_HashedFile, np.dtype, array]] = {}
        self.min_id: int | None = None
        self.max_id: int | None = None

    @property
    def documents(self) -> int:
        return len(self._offsets) - 1

    def add(self, document: Mapping[str, Any]) -> None:
        """Append one document ``{"input_ids": [n], KEY: [n], ...}`` (validated: ids in range, aligned extras)."""
        index = self.documents
        ids = _written_ids(self.name, index, document, self.limit)
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            self.min_id = low if self.min_id is None else min(self.min_id, low)
            self.max_id = high if self.max_id is None else max(self.max_id, high)
        self._tokens.write(ids.astype(self.dtype).tobytes())
        for key, value in document.items():
            if key != "input_ids":
                self._add_extra(key, np.asarray(value).reshape(-1), ids.shape[0], index)
        for file, dtype, present in self._extras.values():
            if len(present) == index:  # this document lacks the key: keep the files aligned
                file.write(np.zeros(ids.shape[0], dtype=dtype).tobytes())
                present.append(0)
        self._offsets.append(self._offsets[-1] + ids.shape[0])

    def _add_extra(self, key: str, value: np.ndarray, n: int, index: int) -> None:
        if value.shape[0] != n:
            raise ValueError(f"document {index}: {key!r} has {value.shape[0]} entries but input_ids has {n}")
        if value.dtype.kind not in "biuf":
            raise TypeError(f"document {index}: {key!r} must be numeric per-token data, got {value.dtype}")
        if key not in self._extras:
            if not key.replace("_", "").isalnum():
                raise ValueError(f"document {index}: per-token key {key!r} must be alphanumeric (it names a file)")
            dtype = value.dtype.newbyteorder("<")
            file = _HashedFile(self.directory / f"{key}.bin")
            file.write(np.zeros(self._offsets[-1], dtype=dtype).tobytes())  # documents before the first one
            self._extras[key] = (file, dtype, array("b", [0] * index))
        file, dtype, present = self._extras[key]
        cast = value.astype(dtype)
        if not np.array_equal(cast, value):
            raise ValueError(f"document {index}: {key!r} does not fit the dtype {dtype} of earlier documents")
        file.write(cast.tobytes())
        present.append(1)

    def finish(self, source: Mapping[str, Any], *, labels_alignment: str | None = None) -> dict[str, Any]:
        """Close the files, write the index and the manifest (with ``labels_alignment`` when the writer knows it);
        returns the manifest."""
        offsets = np.frombuffer(self._offsets, dtype=np.int64)
        files = {"tokens": self._tokens.close(), "offsets": _saved(self.directory / OFFSETS_FILE, offsets)}
        extras = {}
        for key, (file, dtype, present) in sorted(self._extras.items()):
            files[key] = file.close()
            flags = np.frombuffer(present, dtype=np.int8).astype(bool)
            files[f"{key}.present"] = _saved(self.directory / f"{key}.present.npy", flags)
            extras[key] = dtype.str
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "documents": self.documents,
            "tokens": int(offsets[-1]),
            "dtype": self.dtype.str,
            "vocab_size": self.vocab_size,
            "min_id": self.min_id,
            "max_id": self.max_id,
            "extras": extras,
            "labels_alignment": labels_alignment,
            "chunk_bytes": CHUNK_BYTES,
            "chunk_hash": CHUNK_HASH,
            "files": files,
            "source": dict(source),
        }
        return write_manifest(self.directory, manifest)
