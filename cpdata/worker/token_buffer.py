"""Token buffers: the per-token arrays of many documents concatenated once, for every CP rank to gather from.

A packing window's documents become one :class:`TokenBuffer` when read; its packs refer to it by offset,
so tokens are read once per window and once per rank. Pieces in no common buffer are concatenated per
batch by the same :func:`concatenate_arrays`.

Layout of ``W`` elements: each item's ids, then its last token's target (-100 after a document,
``next_label`` after a piece), so next-token targets are ``ids[index + 1]``; then ``ids[W]`` = 0 and
``ids[W + 1]`` = -100, what a pad position reads. ``labels`` (``[W + 1]``, when some item has labels) and
each extra key (``[W + 1]``, 0 where absent) follow the same layout. :class:`BufferPool` reuses the
large ``ids`` arrays: fresh ones per window cost more in page faults than the copy."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS, LABELS

__all__ = ["BufferPool", "TokenBuffer", "concatenate_arrays", "concatenate_spaced"]

_ZERO = np.zeros(1, dtype=np.int64)

@dataclass(frozen=True, eq=False, slots=True)
class TokenBuffer:
    """Per-token arrays of ``W`` tokens, concatenated (trailing elements: the module docstring).

    Attributes:
        ids: int64 ``[W + 2]``.
        labels: int64 ``[W + 1]``, or None when no document carries labels.
        extras: key -> ``[W + 1]`` (the documents' dtypes, promoted), keys sorted.
    """

    ids: np.ndarray
    labels: np.ndarray | None
    extras: Mapping[str, np.ndarray]

    @property
    def total(self) -> int:
        """``W``: the elements of the buffer; ``ids[W]`` is the pad element."""
        return self.ids.shape[0] - 2


def _unused_refs() -> int:
    """What ``sys.getrefcount`` reports for an array held by a list alone, measured rather than
    assumed (a count too low would hand out an array still in use)."""
    held = [np.empty(1, dtype=np.int64)]
    return sys.getrefcount(held[0])


_UNUSED_REFS = _unused_refs()


class BufferPool:
    """A few int64 arrays handed out again once nothing refers to them (their reference count says so).

    ``take(n)`` returns an int64 ``[n]`` view of a free pooled array, grown when too short, or a new array
    (pooled while fewer than ``size`` are). Pooled arrays are twice as long as asked, since pages never
    written cost nothing. Not thread-safe: one pool per reading node."""

    __slots__ = ("_arrays", "size")

    def __init__(self, size: int = 4) -> None:
        self._arrays: list[np.ndarray] = []
        self.size = size

    def take(self, n: int) -> np.ndarray:
        """int64 ``[n]``, uninitialised; valid while the caller (or anything made from it) holds it."""
        arrays = self._arrays
        for i in range(len(arrays)):
            if sys.getrefcount(arrays[i]) == _UNUSED_REFS:  # nothing else holds it
                if arrays[i].shape[0] < n:
                    arrays[i] = np.empty(2 * max(n, arrays[i].shape[0]), dtype=np.int64)
                return arrays[i][:n]
        if len(arrays) >= self.size:
            return np.empty(n, dtype=np.int64)
        arrays.append(np.empty(2 * n, dtype=np.int64))  # pages never written cost nothing
        return arrays[-1][:n]


def concatenate_spaced(arrays: Sequence[np.ndarray], out: np.ndarray) -> None:
    """Write ``arrays`` into ``out`` one after another, each followed by one spare element (0, for the caller
    to set): ``out`` has ``sum(map(len, arrays)) + len(arrays)`` elements, the layout of a token buffer."""
    if len(arrays):
        parts = [_ZERO] * (2 * len(arrays))
        parts[::2] = arrays
        np.concatenate(parts, out=out, casting="unsafe")


def concatenate_arrays(
    arrays: Sequence[Mapping[str, np.ndarray]],
    lengths: Sequence[int] | np.ndarray,
    ends: np.ndarray,
    ids: np.ndarray | None = None,
    pool: BufferPool | None = None,
) -> TokenBuffer:
    """The :class:`TokenBuffer` of items ``arrays`` in order, each followed by its ``ends`` value
    (int64 ``[n]``); item ``i`` (``lengths[i]`` tokens) starts at ``sum(lengths[:i]) + i``.

    ``arrays``: each item's ``input_ids`` and optional ``labels`` and extras (may be empty when ``ids`` is
    given and items hold ``input_ids`` alone); ``ids``: int64 ``[W + 2]`` already holding the ids one
    element apart (the window check made them), else concatenated here, into an array of ``pool``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.shape[0]
    after = lengths.cumsum()
    after += np.arange(n, dtype=np.int64)  # index of each item's end element
    total = int(after[-1]) + 1 if n else 0
    if ids is None:
        ids = pool.take(total + 2) if pool is not None else np.empty(total + 2, dtype=np.int64)
        concatenate_spaced([a[INPUT_IDS] for a in arrays], ids[:total])
    ids[after] = ends
    ids[total : total + 2] = 0, IGNORE_INDEX  # what a pad position reads
    if max(map(len, arrays), default=1) == 1:  # input_ids alone (the usual case)
        return TokenBuffer(ids, None, {})
    keys = sorted(set().union(*(a.keys() for a in arrays)) - {INPUT_IDS})
    extras: dict[str, np.ndarray] = {}
    starts = (after - lengths).tolist()
    for key in keys:
        if key == LABELS:  # next-token targets where an item has no labels, then ids[W + 1] = -100
            out = ids[1 : total + 2].copy()
        else:
            out = np.zeros(total + 1, dtype=np.result_type(*[a[key].dtype for a in arrays if key in a]))
        for a, at, k in zip(arrays, starts, lengths.tolist(), strict=True):
            if key in a:
                out[at : at + k] = a[key]
        extras[key] = out
    return TokenBuffer(ids, extras.pop(LABELS, None), extras)
