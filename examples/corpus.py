"""Documents for the demo: the running Python's standard library, byte-level.

The default corpus is every ``.py`` file under ``sysconfig``'s ``stdlib``
path (``site-packages`` and caches excluded), sorted by relative path, one file
per document, tokenized as raw bytes (ids 0..255; id 256 is padding). No
download, deterministic for a given Python: CPython 3.11 ships ~1,800 files,
~31 MB, median 6.5 KB (so most files are longer than a small pack and are split
across packs). Files are read on access, not up front.

``--data`` alternatives: a JSONL file of ``{"text": ...}`` (UTF-8 bytes) or
``{"input_ids": [...]}`` rows, or a directory written by ``cpdata precompute``
(handled by ``cpdata.recipes.precomputed``).
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "BYTE_VOCAB", "PAD_ID", "StdlibCorpus", "StdlibDefinitions", "encode_text", "load_jsonl", "stdlib_files",
]  # fmt: skip

BYTE_VOCAB = 257
"""256 byte values plus the padding token."""
PAD_ID = 256

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Non-empty ``.py`` files under the standard library, sorted by relative path."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for d, dirs, files in os.walk(base):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
        for name in files:
            path = Path(d, name)
            if name.endswith(".py") and path.is_file() and path.stat().st_size > 0:
                found.append(path)
    if not found:
        raise ValueError(f"no .py files under {str(base)!r}; pass --data with a JSONL file instead")
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def encode_text(text: str) -> np.ndarray:
    """UTF-8 bytes as int64 token ids ``[n]`` in 0..255."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


class StdlibCorpus(Sequence):
    """Sequence of ``{"input_ids": int64 [n]}``, one standard-library file each, read lazily."""

    def __init__(self, root: str | os.PathLike | None = None, limit: int | None = None) -> None:
        files = stdlib_files(root)
        self.files = files[:limit] if limit is not None else files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        data = self.files[index].read_bytes()
        return {"input_ids": np.frombuffer(data, dtype=np.uint8).astype(np.int64)}


_BLOCK_STARTS = tuple(indent + word for indent in (b"", b"    ") for word in (b"def ", b"async def ", b"@"))
_BLOCK_STARTS += (b"class ",)


def _block_offsets(data: bytes) -> list[int]:
    """Byte offsets where a block starts: a def, class or decorator at column 0, or a method at indent 4.

    A decorated definition starts at its first decorator.
    """
    offsets, previous = [0], b""
    position = 0
    for line in data.splitlines(keepends=True):
        if position and line.startswith(_BLOCK_STARTS) and not previous.lstrip().startswith(b"@"):
            offsets.append(position)
        if line.strip():
            previous = line
        position += len(line)
    return offsets


class StdlibDefinitions(Sequence):
    """The standard library cut into definitions: one document per module preamble, function, class header or method.

    The demo's default corpus. Whole files are mostly longer than a small pack
    (97 % of the stdlib's bytes sit in files over 4 KB), so a 4K pack would
    nearly always hold one split piece; definitions (functions, methods, class
    bodies up to their first method) make packs of many documents of mixed
    length, which is what packing, padding and CP balance are about. Every byte of
    every file is in exactly one document. Indexing reads all files once at
    construction (~31 MB, well under a second); documents are read on access.
    """

    def __init__(self, root: str | os.PathLike | None = None, limit: int | None = None) -> None:
        self.files = StdlibCorpus(root, limit).files
        spans = []
        for f, path in enumerate(self.files):
            data = path.read_bytes()
            bounds = _block_offsets(data) + [len(data)]
            spans.extend((f, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a)
        self.spans = np.asarray(spans, dtype=np.int64).reshape(-1, 3)

    def __len__(self) -> int:
        return int(self.spans.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[n_docs]`` tokens (bytes) per definition, known without reading a file: a global schedule
        (``build_loader(..., plan=SchedulePlan())``) plans from these."""
        return self.spans[:, 2] - self.spans[:, 1]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        f, a, b = (int(x) for x in self.spans[index])
        with open(self.files[f], "rb") as fh:
            fh.seek(a)
            data = fh.read(b - a)
        return {"input_ids": np.frombuffer(data, dtype=np.uint8).astype(np.int64)}


def load_jsonl(path: str | os.PathLike, vocab_size: int = BYTE_VOCAB) -> list[dict[str, np.ndarray]]:
    """Documents from JSONL rows ``{"text": str}`` or ``{"input_ids": [int, ...]}``.

    Other keys of ``input_ids`` rows that hold equal-length lists (``labels``,
    ``loss_mask``) are kept as per-token arrays.
    """
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "text" in row:
                doc = {"input_ids": encode_text(row["text"])}
            elif "input_ids" in row:
                doc = {k: np.asarray(v, dtype=np.int64) for k, v in row.items()
                       if isinstance(v, list) and len(v) == len(row["input_ids"])}
            else:
                raise ValueError(f"{path}:{line_no}: row has keys {sorted(row)}; expected 'text' or 'input_ids'")
            ids = doc["input_ids"]
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"{path}:{line_no}: token ids must lie in [0, {vocab_size}), "
                                 f"got range [{ids.min()}, {ids.max()}]")
            if ids.size:
                docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: no non-empty documents")
    return docs
