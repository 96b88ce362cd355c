"""``dataset[a:b]``: a slice of a tokenized dataset as a dataset of its own (a view, nothing is copied).

::

    docs = open_dataset("tokens/")[:1000]        # the first 1000 documents
    build_loader(docs, capacity=..., ...)         # or precompute(docs, ...)

A :class:`DatasetSlice` holds its parent and the parent's document indices
(``range(n)[a:b:c]``, int64, 8 B per document); document ``i`` of the slice is
document ``indices[i]`` of the parent, read through the parent (so its checks
apply: JSONL CRCs, token store chunk checksums). Its lengths are the parent's
at those indices, its fingerprint and checksum the parent's plus the slice,
so a resume or a plan is bound to the same documents of the same data.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from cpdata.sources.base import TokenizedDataset

__all__ = ["DatasetSlice"]


class DatasetSlice(TokenizedDataset):
    """Documents ``parent[s]`` for a slice ``s`` (what ``parent[a:b:c]`` returns).

    Args:
        parent: the dataset sliced.
        part: a ``slice``, resolved against ``len(parent)`` as Python does for ranges.
    """

    def __init__(self, parent: TokenizedDataset, part: slice) -> None:
        super().__init__(parent.path)
        self.parent = parent
        self.start, self.stop, self.step = part.indices(len(parent))
        self.indices = np.arange(self.start, self.stop, self.step, dtype=np.int64)
        self.kind = parent.kind
        self.serves_tokens = parent.serves_tokens
        self.per_token_keys = parent.per_token_keys
        alignment = getattr(parent, "labels_alignment", None)
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

    def _compute_checksum(self) -> str:
        return hashlib.sha256(f"{self.parent.checksum()}{self._part}".encode()).hexdigest()

    def fingerprint(self) -> str:
        hook = getattr(self.parent, "fingerprint", None)
        parent = hook() if callable(hook) else f"{self.parent.kind}:{len(self.parent)}"
        return f"{parent}{self._part}"

    def check_unchanged(self) -> None:
        hook = getattr(self.parent, "check_unchanged", None)
        if callable(hook):
            hook()

    def __repr__(self) -> str:
        return f"{self.parent!r}{self._part}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_lengths": None}
