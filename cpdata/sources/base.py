"""``TokenizedDataset``: the base every reader of tokenized documents shares (indexing, slices, id checks).

Readers of each format subclass it; :func:`cpdata.sources.open.open_dataset` picks one from a path.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.errors import is_int
from cpdata.sources.protocol import declared_labels

__all__ = ["DatasetSlice", "TokenizedDataset"]

def _check_ids(path: Path, index: int, ids: np.ndarray, vocab_size: int | None) -> None:
    if not ids.shape[0]:
        return
    low = int(ids.argmin())
    if ids[low] < 0:
        raise ValueError(
            f"{path}: document {index} has token id {int(ids[low])} at position {low}; token ids index the "
            "vocabulary and must be >= 0 (do not pre-pad with negative ids: cpdata pads with padding_token_id; "
            "put ignored targets such as -100 in 'labels')"
        )
    high = int(ids.argmax())
    if vocab_size is not None and ids[high] >= vocab_size:
        raise ValueError(
            f"{path}: document {index} has token id {int(ids[high])} at position {high}, >= vocab_size={vocab_size}; "
            "check the tokenizer or --vocab-size"
        )


def _written_ids(name: Path, index: int, document: Any, limit: int) -> np.ndarray:
    """A document's ``input_ids`` about to be written: 1-D integers in ``[0, limit)``, else the error names it."""
    ids = np.asarray(document["input_ids"]).reshape(-1)
    if ids.size and ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: document {index}: input_ids must be integers, got {ids.dtype}")
    _check_ids(name, index, ids.astype(np.int64, copy=False), limit)
    return ids


class TokenizedDataset(ABC):
    """A dataset of tokenized documents addressed by index; ``lengths`` is int64 ``[n_docs]`` (may be
    memory-mapped), ``serves_tokens`` False for a lengths-only file."""

    kind: str = ""
    serves_tokens: bool = True
    per_token_keys: frozenset[str] = frozenset()
    """Per-token keys besides ``input_ids`` that some document carries (``labels``, masks)."""
    _transient: tuple[str, ...] = ()
    """Attributes a pickled copy (a worker's) leaves out: handles, maps and caches it rebuilds."""
    _id_range: tuple[int, int] | None = None
    """``(lowest, highest)`` id of every document when the reader knows it without reading them ((0, -1): none)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths  # set by the reader, or computed on first use by an override

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Document ``i`` as ``{"input_ids": int64 [n], "labels"?: [n], ...}``; a slice gives a :class:`DatasetSlice` view."""
        if isinstance(i, slice):
            return DatasetSlice(self, i)  # type: ignore[return-value]
        n = len(self)
        if not is_int(i):
            raise TypeError(f"documents are addressed by an int index or a slice (dataset[:1000], a view), got "
                            f"{type(i).__name__} {i!r}")  # fmt: skip
        if not -n <= i < n:
            raise IndexError(f"document index {i} out of range for {n} documents in {self.path}")
        return self._read(int(i) % n)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(len(self)):
            yield self[i]

    @abstractmethod
    def _read(self, i: int) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def fingerprint(self) -> str:
        """The one identity a resume or a plan binds to (:mod:`cpdata.sources.fingerprint`)."""

    @abstractmethod
    def check_unchanged(self) -> None:
        """Raise ``ValueError`` naming what changed since the data was opened."""

    def check_token_ids(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first document holding an id ``< 0`` or ``>= vocab_size`` (reads
        every document unless ``_id_range`` is known and within bounds)."""
        low, high = self._id_range or (-1, 0)  # unknown: read every document
        if not self.serves_tokens or (low >= 0 and (vocab_size is None or high < vocab_size)):
            return
        for i in range(len(self)):
            _check_ids(self.path, i, self._read(i)["input_ids"], vocab_size)

    def verify_content(self) -> None:  # noqa: B027 (a no-op unless the format records checksums)
        """Check every stored byte against checksums recorded with the data (a token store); ``precompute``
        calls it."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, documents={len(self)})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **dict.fromkeys(self._transient)}


class DatasetSlice(TokenizedDataset):
    """Documents ``parent[s]`` for a slice ``s`` (what ``parent[a:b:c]`` returns): a view, nothing is copied.

    Document ``i`` is read through the parent (its checks apply); ``indices`` costs 8 B per document. The
    fingerprint is the parent's plus the slice, so a resume or a plan binds to the same documents.
    """

    _transient = ("_lengths",)

    def __init__(self, parent: TokenizedDataset, part: slice) -> None:
        super().__init__(parent.path)
        self.parent = parent
        self.start, self.stop, self.step = part.indices(len(parent))
        self.indices = np.arange(self.start, self.stop, self.step, dtype=np.int64)
        self.kind = parent.kind
        self.serves_tokens = parent.serves_tokens
        self.per_token_keys = parent.per_token_keys
        alignment = declared_labels(parent)
        if alignment is not None:
            self.labels_alignment = alignment
        self._lengths: np.ndarray | None = None

    @property
    def _part(self) -> str:
        return f"[{self.start}:{self.stop}:{self.step}]"

    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            self._lengths = np.asarray(self.parent.lengths, dtype=np.int64)[self.indices]
        return self._lengths

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def _read(self, i: int) -> dict[str, np.ndarray]:
        return self.parent[int(self.indices[i])]

    def describe_document(self, i: int) -> str | None:
        """``"document 7 of the slice [5:100:1] (document 12 of PATH)"``: errors name both indices."""
        if not 0 <= i < len(self):
            return None
        return f"document {i} of the slice {self._part} (document {int(self.indices[i])} of {self.parent.path})"

    def verify_content(self) -> None:
        self.parent.verify_content()

    def fingerprint(self) -> str:
        return f"{self.parent.fingerprint()}{self._part}"

    def check_unchanged(self) -> None:
        self.parent.check_unchanged()

    def __repr__(self) -> str:
        return f"{self.parent!r}{self._part}"
