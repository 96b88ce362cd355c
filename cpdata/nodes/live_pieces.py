"""``LivePieces``: the pieces a packer has placed and not yet emitted, as one int64 table.

One row per piece: ``(key, index, start, length, next_label, slot, offset)``
(:data:`FIELDS`) and, beside the table, the per-token arrays the piece is cut
from (``source[key][offset : offset + length]``; usually the whole document's
arrays, so nothing is sliced until collate reads the tokens). Keys grow with
arrival, so a pack's pieces are found by one ``searchsorted`` over the key
column, and a window adds its pieces with one ``concatenate``: no object per
piece. Emitted rows are only marked dead; they are dropped when the next
window arrives (the table holds the carried pieces plus one window).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["FIELDS", "LivePieces"]

FIELDS: tuple[str, ...] = ("key", "index", "start", "length", "next_label", "slot", "offset")
"""Columns of :attr:`LivePieces.table`."""

Source = Mapping[str, np.ndarray]


class LivePieces:
    """Placed, not yet emitted pieces: ``table`` int64 ``[p, 7]`` (:data:`FIELDS`) and ``sources`` ``[p]``."""

    __slots__ = ("table", "sources", "_alive")

    def __init__(self) -> None:
        self.table = np.zeros((0, len(FIELDS)), dtype=np.int64)
        self.sources: list[Source] = []
        self._alive = np.zeros(0, dtype=bool)

    def __len__(self) -> int:
        return int(self._alive.sum())

    def live(self) -> tuple[np.ndarray, list[Source]]:
        """The rows not yet taken, in key order (the table is compacted to them): ``([c, 7], sources)``.

        The returned table is never written again (a later :meth:`add` builds a new one), so a
        snapshot may keep it.
        """
        if not self._alive.all():
            keep = np.flatnonzero(self._alive)
            self.table = self.table[keep]
            self.sources = [self.sources[i] for i in keep.tolist()]
            self._alive = np.ones(keep.size, dtype=bool)
        return self.table, self.sources

    def add(self, rows: np.ndarray, sources: Sequence[Source]) -> None:
        """Append pieces: ``rows`` int64 ``[p, 7]`` with keys above every key held, ``sources`` ``[p]``."""
        table, held = self.live()
        self.table = np.concatenate([table, rows]) if table.size else rows
        self.sources = [*held, *sources]
        self._alive = np.ones(self.table.shape[0], dtype=bool)

    def take(self, keys: np.ndarray) -> tuple[np.ndarray, list[Source]]:
        """Remove the pieces of ``keys`` (int64 ``[k]``, held): their rows ``[k, 7]`` and sources, in ``keys``' order."""
        pos = np.searchsorted(self.table[:, 0], keys)
        if keys.size and (pos.max() >= self.table.shape[0] or not np.array_equal(self.table[pos, 0], keys)
                          or not self._alive[pos].all()):  # fmt: skip
            raise KeyError(f"pieces {keys.tolist()[:8]} are not all held")
        self._alive[pos] = False
        sources = self.sources
        return self.table[pos], [sources[i] for i in pos.tolist()]
