"""Token buffers: the per-token arrays of many documents concatenated once, for every CP rank to gather from.

A packing window's documents are concatenated into one :class:`TokenBuffer`
when the window is read (the ids already are, to check their values in one
pass); every pack the window finishes refers to it, each piece by its offset
in the buffer, and a rank's tokens are gathered straight from it
(:mod:`cpdata.worker.collate`): no per-pack concatenation, the tokens are read from
memory once per window and once per rank. The pieces a window's packs emit
that are not among its documents (carried over from an earlier window, cut
short) are copied after them (:func:`cpdata.nodes.live_pieces.window_buffer`).
Pieces in no common buffer (precomputed or hand-made plans, a batch of plans of
several windows) get a buffer of their own, concatenated per batch by the same
:func:`concatenate_arrays`.

Layout of a buffer of ``W`` elements: every document's (or piece's) ids
followed by one element, the target of its last token (-100 after a document,
``next_label`` after a piece), so next-token targets are simply
``ids[index + 1]``; then ``ids[W]``, the pad a pad position reads (0), and
``ids[W + 1]`` = -100, the target a pad position reads (``ids`` int64
``[W + 2]``). ``labels`` int64 ``[W + 1]`` when some document carries labels
(its labels, next-token ids for documents without; ``labels[W]`` = -100); one
``[W + 1]`` array per extra key (0 for documents without it and at ``[W]``).

:class:`BufferPool` hands out the large ``ids`` arrays: a buffer is reused only
once nothing refers to it any more (no pack of its window is alive), because a
fresh multi-MB array per window costs page faults that outweigh the copy itself
(figures: docs/benchmarks.md).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS, LABELS

__all__ = ["BufferPool", "TokenBuffer", "concatenate_arrays"]

_INT64 = np.dtype(np.int64)


@dataclass(frozen=True, eq=False, slots=True)
class TokenBuffer:
    """Per-token arrays of ``W`` tokens, concatenated (see the module docstring for the trailing elements).

    Attributes:
        ids: int64 ``[W + 2]``: each item's ids, then the target of its last token.
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
    """What ``sys.getrefcount`` reports for an array held by a list alone, read the way :class:`BufferPool`
    reads its arrays: 2 on CPython up to 3.13 (the list and the call's argument), and whatever an interpreter
    that borrows the argument reports, measured rather than assumed (a count too low would hand out an array
    still in use)."""
    held = [np.empty(1, dtype=np.int64)]
    return sys.getrefcount(held[0])


_UNUSED_REFS = _unused_refs()


class BufferPool:
    """A few int64 arrays handed out again once nothing refers to them any more.

    ``take(n)`` returns an int64 ``[n]`` view of a pooled array that no view
    or buffer made from it earlier still uses (its reference count says so),
    grown when too short; when every pooled array is in use a new one is made
    (and pooled while fewer than ``size`` are). Pooled arrays are made twice
    as long as asked: windows vary in size (and in the room kept for carried
    pieces), and a page never written costs nothing, while a new array for a
    slightly longer window would fault in every page again. Not thread-safe:
    one pool per reading node.
    """

    __slots__ = ("_arrays", "size")

    def __init__(self, size: int = 4) -> None:
        self._arrays: list[np.ndarray] = []
        self.size = size

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._arrays[i]) == _UNUSED_REFS

    def take(self, n: int) -> np.ndarray:
        """int64 ``[n]``, uninitialised; valid for as long as the caller (or anything made from it) holds it."""
        arrays = self._arrays
        for i in range(len(arrays)):
            if self._free(i):
                if arrays[i].shape[0] < n:
                    arrays[i] = np.empty(2 * max(n, arrays[i].shape[0]), dtype=np.int64)
                return arrays[i][:n]
        if len(arrays) >= self.size:
            return np.empty(n, dtype=np.int64)
        arrays.append(np.empty(2 * n, dtype=np.int64))  # pages never written cost nothing
        return arrays[-1][:n]


def concatenate_arrays(
    arrays: Sequence[Mapping[str, np.ndarray]],
    lengths: Sequence[int] | np.ndarray,
    ends: np.ndarray,
    ids: np.ndarray | None = None,
    pool: BufferPool | None = None,
) -> TokenBuffer:
    """The :class:`TokenBuffer` of documents (or pieces) ``arrays``, in order, each followed by its ``ends`` value.

    Element ``ends[i]`` after the ``lengths[i]`` ids of item ``i`` is the next-token target of its
    last token, so next-token targets are ``ids[index + 1]`` for every token: -100 after a whole
    document, a piece's ``next_label`` after a piece. The buffer holds ``W = sum(lengths) + n``
    elements; item ``i`` starts at ``sum(lengths[:i]) + i``.

    Args:
        arrays: per-token arrays of each item: ``input_ids`` ``[n_i]`` and optional ``labels``
            (int targets) and extra keys, each ``[n_i]``; may be empty when ``ids`` are given and every
            item holds ``input_ids`` alone.
        lengths: int ``[n]`` tokens of each.
        ends: int64 ``[n]``.
        ids: int64 ``[W + 2]`` whose first ``W`` elements already hold the items' ids with one
            element between each (overwritten here by ``ends``; the window check made them);
            concatenated here (into an array of ``pool`` when given) when None.

    Cost: one ``concatenate`` per key (ids skipped when given), labels and extras only when some
    item carries them; O(items) Python beside.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.shape[0]
    after = lengths.cumsum()
    after += np.arange(n, dtype=np.int64)  # index of each item's end element
    total = int(after[-1]) + 1 if n else 0
    if ids is None:
        ids = pool.take(total + 2) if pool is not None else np.empty(total + 2, dtype=np.int64)
        if n:
            parts: list[np.ndarray] = [ends[:1]] * (2 * n)
            parts[0::2] = [a[INPUT_IDS] for a in arrays]
            parts[1::2] = list(ends.reshape(n, 1))
            np.concatenate(parts, out=ids[:total], casting="unsafe")
    ids[after] = ends
    ids[total] = 0
    ids[total + 1] = IGNORE_INDEX
    if max(map(len, arrays), default=1) == 1:  # input_ids alone (the usual case)
        return TokenBuffer(ids, None, {})
    keys = sorted(set().union(*(a.keys() for a in arrays)) - {INPUT_IDS})
    labels = None
    extras: dict[str, np.ndarray] = {}
    starts = (after - lengths).tolist()
    for key in keys:
        if key == LABELS:
            out = np.empty(total + 1, dtype=np.int64)
            out[:total] = ids[1 : total + 1]  # next-token targets where an item has no labels
            out[total] = IGNORE_INDEX
        else:
            out = np.zeros(total + 1, dtype=np.result_type(*[a[key].dtype for a in arrays if key in a]))
        for a, at, k in zip(arrays, starts, lengths.tolist(), strict=True):
            if key in a:
                out[at : at + k] = a[key]
        if key == LABELS:
            labels = out
        else:
            extras[key] = out
    return TokenBuffer(ids, labels, extras)
