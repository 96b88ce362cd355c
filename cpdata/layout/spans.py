"""Span tables: a layout dealt as spans of consecutive positions, each owned by one rank (``tiled``'s
blocks, ``world``'s runs), with the run tables' verbs.

A pack's spans tile ``[0, pack_len)`` in global order; a rank's spans, in that order, are its local order. A
row or the inverse map is one ``repeat`` and one add over the spans (:func:`~cpdata.layout.runs.segments`).
"""

from __future__ import annotations

import numpy as np

from cpdata.layout.runs import Table, _arange, _within_packs, segments

__all__ = ["SpanBlock", "SpanTable"]


class SpanBlock:
    """The spans of ``P`` packs of ``pack_len`` tokens, pack after pack, with the
    :class:`~cpdata.layout.runs.RunBlock` verbs (:meth:`tables`, :meth:`doc_counts`, :meth:`causal_work`).

    ``lens`` int64 ``[N]``: slot lengths, ``counts`` int64 ``[P]`` slots per pack (None: one); int64 ``[S]``
    ``starts`` (pack-local, increasing in a pack), ``lengths``, ``owners``; ``spans`` int64 ``[P]``: per pack.
    """

    __slots__ = ("pack_len", "cp_size", "lens", "counts", "starts", "lengths", "owners", "spans", "key",
                 "major", "by_rank", "rank_first", "span_first", "slot_first")  # fmt: skip

    def __init__(self, pack_len: int, cp_size: int, lens: np.ndarray, counts: np.ndarray | None,
                 starts: np.ndarray, lengths: np.ndarray, owners: np.ndarray,
                 spans: np.ndarray) -> None:  # fmt: skip
        counts = np.array([lens.shape[0]], dtype=np.int64) if counts is None else counts
        n_packs = counts.shape[0]
        self.pack_len, self.cp_size, self.lens, self.counts = pack_len, cp_size, lens, counts
        self.starts, self.lengths, self.owners, self.spans = starts, lengths, owners, spans
        key = owners if n_packs == 1 else owners + _arange(n_packs, cp_size).repeat(spans)
        self.key = key  # int64 [S]: pack * cp + owner
        by_rank = self.by_rank = key.argsort(kind="stable")  # each pack's ranks in turn, their spans in order
        sizes = lengths[by_rank]
        self.major = np.empty_like(starts)  # each span's first rank-major index in its pack
        self.major[by_rank] = sizes.cumsum() - sizes - key[by_rank] // cp_size * pack_len
        self.rank_first = key[by_rank].searchsorted(_arange(n_packs * cp_size + 1)).tolist()
        self.span_first = np.concatenate([[0], spans.cumsum()]).tolist()
        self.slot_first = np.concatenate([[0], counts.cumsum()]).tolist()

    def tables(self) -> list[SpanTable]:
        """One :class:`SpanTable` per pack."""
        return [SpanTable(self, p) for p in range(self.counts.shape[0])]

    def doc_counts(self) -> list[int]:
        """Slots of each pack (what :meth:`causal_work` takes a real length for)."""
        return self.counts.tolist()

    def causal_work(self, real: np.ndarray) -> np.ndarray:
        """float64 ``[P, cp]``: causal document-masked attention work per rank (``real`` int64 ``[N]``: real
        tokens of each slot). A span costs ``W(end) - W(start)``, ``W`` the doubled work before a position,
        packs laid back to back: integers, summed exactly by one ``bincount`` over ``pack * cp + owner``."""
        lens, counts, p, cp = self.lens, self.counts, self.pack_len, self.cp_size
        n_packs = counts.shape[0]
        if lens.size == 0:
            return np.zeros((n_packs, cp), dtype=np.float64)
        real = np.asarray(real, dtype=np.int64)
        offsets = _within_packs(lens[None], counts)[0][0] + _arange(n_packs, p).repeat(counts)  # slot starts
        twice = real * (real + 1)
        below = np.cumsum(twice) - twice  # 2 W(each slot's start)
        # span starts, packs back to back, then the last pack's end: a span ends where the next one starts
        at = np.append(self.starts + _arange(n_packs, p).repeat(self.spans), n_packs * p)
        k = np.maximum(offsets.searchsorted(at, side="right") - 1, 0)
        into = np.clip(at - offsets[k], 0, real[k])
        w = below[k] + into * (into + 1)
        return (np.bincount(self.key, w[1:] - w[:-1], minlength=n_packs * cp) / 2).reshape(n_packs, cp)


class SpanTable(Table):
    """Pack ``p`` of a :class:`SpanBlock`, with the :class:`~cpdata.layout.runs.RunTable` verbs."""

    __slots__ = ("block", "p", "pack_len", "cp_size", "_lo", "_hi")

    def __init__(self, block: SpanBlock, p: int) -> None:
        self.block, self.p, self.pack_len, self.cp_size = block, p, block.pack_len, block.cp_size
        self._lo, self._hi = block.span_first[p], block.span_first[p + 1]

    @property
    def lens(self) -> np.ndarray:
        """int64 ``[D]``: the pack's slot lengths (a view)."""
        return self.block.lens[self.block.slot_first[self.p] : self.block.slot_first[self.p + 1]]

    def spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 ``[R]`` ``(starts, owners, local_starts)`` of the pack's spans in global order (a span's
        first index in its rank's local order)."""
        b, lo, hi = self.block, self._lo, self._hi
        owners = b.owners[lo:hi]
        return b.starts[lo:hi], owners, b.major[lo:hi] - owners * (self.pack_len // self.cp_size)

    def row(self, rank: int, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len / cp]``: rank ``rank``'s positions in local order (increasing; into ``out``)."""
        b, k = self.block, self.p * self.cp_size + rank
        at = b.by_rank[b.rank_first[k] : b.rank_first[k + 1]]
        out = np.empty(self.pack_len // self.cp_size, dtype=np.int64) if out is None else out
        return segments(b.starts[at], b.lengths[at], out=out)

    def inverse(self, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len]``: ``inverse[g]`` = position of token ``g`` in the rank-major concatenation."""
        b, lo, hi = self.block, self._lo, self._hi
        out = np.empty(self.pack_len, dtype=np.int64) if out is None else out
        return segments(b.major[lo:hi], b.lengths[lo:hi], out=out)
