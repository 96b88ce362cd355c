"""``DocumentWindow``: one packing window of validated documents, as columns (no object per document)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cpdata.worker.keys import INPUT_IDS
from cpdata.worker.plan import Document
from cpdata.worker.targets import first_target

__all__ = ["DocumentWindow", "WindowFill"]


@dataclass(frozen=True, slots=True)
class DocumentWindow:
    """``n`` validated documents in source order: int64 ``[n]`` ``indices``, ``lengths`` and ``firsts`` (first
    trained target), ``n`` mappings of per-token ``arrays``; ``ids``: int64 ``[>= W + 2]``, the documents' ids
    each followed by one free element, then room (the packer's token buffer), or None; ``plain``: whether
    every document holds ``input_ids`` alone (None: not known)."""

    indices: np.ndarray
    lengths: np.ndarray
    firsts: np.ndarray
    arrays: Sequence[Mapping[str, np.ndarray]]
    ids: np.ndarray | None = None
    plain: bool | None = None

    def ids_alone(self) -> bool:
        return max(map(len, self.arrays), default=1) == 1 if self.plain is None else self.plain

    def __len__(self) -> int:
        return len(self.arrays)

    @classmethod
    def of(cls, documents: Sequence[Document]) -> DocumentWindow:
        """The window of ``documents`` (from a node that emits them one by one)."""
        arrays = [d.arrays for d in documents]
        n = len(arrays)
        return cls(
            indices=np.fromiter((d.index for d in documents), dtype=np.int64, count=n),
            lengths=np.fromiter((a[INPUT_IDS].shape[0] for a in arrays), dtype=np.int64, count=n),
            firsts=np.fromiter((first_target(a) for a in arrays), dtype=np.int64, count=n),
            arrays=arrays,
        )


class WindowFill:
    """The items of a window being read, full with at least ``limit`` documents (None: never) and ``floor``
    tokens, each counting ``min(max(n, 1), capacity)`` (:func:`cpdata.packing.planner.window_ends`)."""

    __slots__ = ("limit", "floor", "capacity", "items", "indices", "ids", "tokens", "_lengths")

    def __init__(self, limit: int | None, floor: int, capacity: int) -> None:
        self.limit, self.floor, self.capacity = limit, floor, capacity
        self.items: list[Any] = []
        self.indices: list[int] = []
        self.ids: list[np.ndarray] = []
        self.tokens = 0
        self._lengths: list[np.ndarray] = []  # int64 runs of the ids' lengths, as counted

    def lengths(self) -> np.ndarray:
        """int64 ``[n]``: the length of every document taken."""
        if len(self._lengths) == 1:
            return self._lengths[0]
        return np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)

    def wants(self) -> bool:
        """Whether the window takes another document."""
        return self.limit is None or len(self.items) < self.limit or self.tokens < self.floor

    def add(self, item: Any, index: int, ids: np.ndarray) -> None:
        """Take one document (``ids`` its int64 ``[n]`` input_ids)."""
        self.items.append(item)
        self.indices.append(index)
        self.ids.append(ids)
        self._lengths.append(np.full(1, ids.shape[0], dtype=np.int64))
        self.tokens += min(max(ids.shape[0], 1), self.capacity)

    def add_run(self, items: Sequence[Any], indices: Sequence[int], ids: Sequence[np.ndarray], lengths: np.ndarray) -> int:
        """Take a run's first documents (all ``[k]``; ``lengths`` int64 ``[k]``) up to where the window is
        full, with one cumulative sum; returns how many."""
        k = len(ids)
        counted = np.cumsum(np.clip(lengths, 1, self.capacity)) + self.tokens
        if self.limit is not None:
            count = np.arange(len(self.items) + 1, len(self.items) + 1 + k)
            full = np.flatnonzero((count >= self.limit) & (counted >= self.floor))
            k = int(full[0]) + 1 if full.size else k
        if k:
            self.items += items[:k]
            self.indices += indices[:k]
            self.ids += ids[:k]
            self._lengths.append(lengths[:k])
            self.tokens = int(counted[k - 1])
        return k
