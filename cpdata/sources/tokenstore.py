"""Binary token store: one flat token file plus an offsets index, memory-mapped (like Megatron's ``.bin/.idx``).

A store directory holds::

    tokens.bin       every document's ids back to back, uint16 (vocab <= 65,536) or uint32, little-endian
    offsets.npy      int64 [n_docs + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
    KEY.bin          per-token extras (labels, loss_mask, assistant_masks, ...), aligned with tokens.bin
    KEY.present.npy  bool [n_docs]: which documents carry KEY (others read back without it)
    manifest.json    format, counts, dtype, min/max id, per-file sha256 and size, the source, and a
                     sha256 of the manifest itself

Opening is O(1) in the corpus size: read the manifest, check file sizes,
memory-map the two files (a 1 GB corpus opens in milliseconds instead of the
JSONL reader's full rescan on every rank and restart). ``lengths`` is one
``np.diff`` of the index, ``checksum()`` is the manifest's digest (which
covers every file's sha256), and the id range check reads the manifest's
min/max. ``verify=True`` re-hashes every file (a few seconds per GB).

Writing is atomic (:func:`cpdata.sources.atomic.atomic_directory`): files go to a
hidden sibling that replaces the target only once the manifest is written.
Documents are appended as they come, so memory stays at one document plus
the index (8 B/document).
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.sources.atomic import atomic_directory
from cpdata.sources.base import TokenizedDataset, _check_ids
from cpdata.sources.manifest import DIGEST_KEY as _DIGEST_KEY
from cpdata.sources.manifest import canonical as _canonical
from cpdata.sources.manifest import manifest_digest as _manifest_digest
from cpdata.sources.manifest import sha256_file as _sha256_file

__all__ = ["FORMAT", "TOKENS_FILE", "TokenStore", "TokenStoreWriter", "is_token_store", "write_token_store"]

FORMAT = "cpdata.tokens"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"
MANIFEST = "manifest.json"
_REWRITE = "rewrite it with `cpdata tokenize` / `cpdata pack-store`"


def is_token_store(path: str | os.PathLike[str]) -> bool:
    """A directory holding ``tokens.bin`` (what :func:`~cpdata.sources.open.open_dataset` dispatches on)."""
    return (Path(path) / TOKENS_FILE).is_file()


def _token_dtype(vocab_size: int | None) -> np.dtype:
    return np.dtype("<u2") if vocab_size is not None and vocab_size <= 1 << 16 else np.dtype("<u4")


class _HashedFile:
    """An append-only file that hashes what it writes."""

    def __init__(self, path: Path) -> None:
        self.path, self.file, self.sha, self.size = path, open(path, "wb"), hashlib.sha256(), 0  # noqa: SIM115

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.sha.update(data)
        self.size += len(data)

    def close(self) -> dict[str, Any]:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"file": self.path.name, "bytes": self.size, "sha256": self.sha.hexdigest()}


class TokenStoreWriter:
    """Append documents to a store being written in ``directory`` (normally an atomic temp directory).

    Args:
        directory: an existing empty directory.
        vocab_size: ids must be below it; ``<= 65536`` stores uint16, else uint32.
        name: what errors call the store (default: ``directory``).
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, vocab_size: int | None = None, name: str | None = None
    ) -> None:
        self.directory = Path(directory)
        self.name = Path(name) if name is not None else self.directory
        self.vocab_size = vocab_size
        self.dtype = _token_dtype(vocab_size)
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
        ids = np.asarray(document["input_ids"]).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise TypeError(f"document {index}: input_ids must be integers, got {ids.dtype}")
        _check_ids(self.name, index, ids.astype(np.int64, copy=False), self.limit if ids.size else None)
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
        """Close the files, write the index and the manifest; returns the manifest.

        ``labels_alignment`` (``"inputs"``/``"targets"``) declares what the stored
        labels and masks are aligned with, when the writer knows it.
        """
        files = {"tokens": self._tokens.close()}
        offsets = np.frombuffer(self._offsets, dtype=np.int64)
        np.save(self.directory / OFFSETS_FILE, offsets, allow_pickle=False)
        files["offsets"] = {"file": OFFSETS_FILE, "bytes": (self.directory / OFFSETS_FILE).stat().st_size,
                            "sha256": _sha256_file(self.directory / OFFSETS_FILE)}  # fmt: skip
        extras = {}
        for key, (file, dtype, present) in sorted(self._extras.items()):
            files[key] = file.close()
            flags = np.frombuffer(present, dtype=np.int8).astype(bool)
            name = f"{key}.present.npy"
            np.save(self.directory / name, flags, allow_pickle=False)
            files[f"{key}.present"] = {"file": name, "bytes": (self.directory / name).stat().st_size,
                                       "sha256": _sha256_file(self.directory / name)}  # fmt: skip
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
            "files": files,
            "source": dict(source),
        }
        manifest[_DIGEST_KEY] = _manifest_digest(manifest)
        with open(self.directory / MANIFEST, "wb") as f:
            f.write(_canonical(manifest))
            f.flush()
            os.fsync(f.fileno())
        return manifest


def write_token_store(
    documents: Iterable[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int | None = None,
    overwrite: bool = False,
    source: Mapping[str, Any] | None = None,
    labels_alignment: str | None = None,
) -> TokenStore:
    """Write ``documents`` (any iterable of ``{"input_ids": ..., KEY: ...}``) as a store at ``out_dir``, atomically.

    ``source`` (JSON-able) and ``labels_alignment`` are recorded in the manifest.
    Returns the store, opened.
    """
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        writer = TokenStoreWriter(tmp, vocab_size=vocab_size, name=str(out_dir))
        for document in documents:
            writer.add(document)
        writer.finish(source or {}, labels_alignment=labels_alignment)
    return TokenStore(out_dir)


class TokenStore(TokenizedDataset):
    """A token store directory as a :class:`~cpdata.sources.base.TokenizedDataset` (O(1) open).

    Args:
        path: the directory.
        verify: re-hash every file against the manifest on open.
    """

    kind = "token_store"

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        super().__init__(path)
        mpath = self.path / MANIFEST
        try:
            manifest = json.loads(mpath.read_bytes())
        except (OSError, ValueError) as e:
            raise ValueError(f"{mpath} cannot be read ({e}); {_REWRITE}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ValueError(f"{mpath} is not a cpdata token store manifest; {_REWRITE}")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{mpath} has format_version {manifest.get('format_version')!r}, this cpdata reads "
                             f"{FORMAT_VERSION}; {_REWRITE}")  # fmt: skip
        if manifest.get(_DIGEST_KEY) != _manifest_digest(manifest):
            raise ValueError(f"{mpath} is corrupted (its digest does not match its content); {_REWRITE}")
        for entry in manifest["files"].values():
            file = self.path / entry["file"]
            size = file.stat().st_size if file.is_file() else None
            if size != entry["bytes"]:
                raise ValueError(f"token store file {file} has {size} bytes, the manifest records "
                                 f"{entry['bytes']}; {_REWRITE}")  # fmt: skip
            if verify and _sha256_file(file) != entry["sha256"]:
                raise ValueError(f"token store file {file} is corrupted (sha256 differs from the manifest); {_REWRITE}")
        self.manifest = manifest
        self.labels_alignment: str | None = manifest.get("labels_alignment")
        """What the stored labels and masks are aligned with, when the writer declared it (``Tokenize``: inputs)."""
        self._checksum = manifest[_DIGEST_KEY]
        self._open()

    def _open(self) -> None:
        n = self.manifest["tokens"]
        self._offsets = np.load(self.path / OFFSETS_FILE, mmap_mode="r", allow_pickle=False)
        self._tokens = self._map(TOKENS_FILE, self.manifest["dtype"], n)
        self._extras = {
            key: (self._map(f"{key}.bin", dtype, n), np.load(self.path / f"{key}.present.npy", mmap_mode="r"))
            for key, dtype in self.manifest["extras"].items()
        }
        self._lengths: np.ndarray | None = None

    def _map(self, name: str, dtype: str, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(self.path / name, dtype=np.dtype(dtype), mode="r", shape=(n,))

    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            self._lengths = np.diff(self._offsets).astype(np.int64, copy=False)
        return self._lengths

    def __len__(self) -> int:
        return int(self.manifest["documents"])

    def _read(self, i: int) -> dict[str, np.ndarray]:
        start, stop = int(self._offsets[i]), int(self._offsets[i + 1])
        out = {"input_ids": self._tokens[start:stop].astype(np.int64)}
        for key, (values, present) in self._extras.items():
            if present[i]:
                out[key] = np.array(values[start:stop])
        return out

    def check_token_ids(self, vocab_size: int | None = None) -> None:
        """From the manifest's min/max (O(1)); the documents are read only to name a culprit."""
        high = self.manifest["max_id"]
        if high is None or vocab_size is None or high < vocab_size:
            return  # negative ids cannot be written
        super().check_token_ids(vocab_size)

    def _compute_checksum(self) -> str:
        return str(self.manifest[_DIGEST_KEY])

    def fingerprint(self) -> str:
        """``token_store:`` + the manifest digest (which covers every file's sha256); see :mod:`cpdata.sources.fingerprint`."""
        return f"token_store:{self._checksum}"

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` if the store was rewritten or a file resized since it was opened (a few ``stat`` s)."""
        on_disk = json.loads((self.path / MANIFEST).read_bytes()).get(_DIGEST_KEY)
        if on_disk != self._checksum:
            raise ValueError(
                f"token store {self.path} was rewritten since it was opened (manifest digest {self._checksum[:16]}… "
                f"then, {str(on_disk)[:16]}… now); a run trains on the store as opened: reopen it and start a new run"
            )
        for entry in self.manifest["files"].values():
            size = os.stat(self.path / entry["file"]).st_size
            if size != entry["bytes"]:
                raise ValueError(f"token store file {self.path / entry['file']} has {size} bytes, the manifest "
                                 f"records {entry['bytes']}; {_REWRITE}")  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_offsets", "_tokens", "_extras", "_lengths"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.check_unchanged()
        self._open()

