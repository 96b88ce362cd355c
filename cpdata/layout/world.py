"""Layout ``world``: the whole DP x CP world as one CP group, short documents whole on one rank.

``cp_size`` is the world (DP folded in); the layout string carries the ranks per node (``"world:8"``,
:func:`cpdata.layout.maps.layout_spec` with ``node_size=``; ``"world"`` is one node), passed by the caller:
nothing here reads the environment, and a world that is not a multiple of the node size is refused. The deal
(:mod:`cpdata.layout.world_deal`) runs on the dataloader worker, so the per-document CP degree costs no
process group per size, no in-step collective and no host sync. :func:`world_block`'s tables have the run
tables' verbs (``tables()``, ``row``, ``inverse``, ``causal_work``): a rank's row and the inverse map are one
``repeat`` and one add over the deal's runs.
"""

from __future__ import annotations

import numpy as np

from cpdata.layout.runs import segments, stacked_rows
from cpdata.layout.world_deal import world_runs

__all__ = ["WorldBlock", "WorldTable", "world_block"]


class WorldTable:
    """One pack's deal as runs: ``starts``, ``lengths``, ``owners`` int64 ``[R]`` sorted by global start, and
    ``local_starts`` (each run's index in its rank's local order; a rank's runs in increasing global order).

    Attributes:
        pack_len, cp_size, node_size: the pack's shape.
        slot_lens: int64 ``[D]``: the pack's slot lengths.
    """

    __slots__ = ("pack_len", "cp_size", "node_size", "slot_lens", "starts", "lengths", "owners", "local_starts",
                 "_by_rank", "_rank_first")  # fmt: skip

    def __init__(self, slot_lens: np.ndarray, pack_len: int, cp_size: int, node_size: int, starts: np.ndarray,
                 lengths: np.ndarray, owners: np.ndarray) -> None:  # fmt: skip
        self.pack_len, self.cp_size, self.node_size, self.slot_lens = pack_len, cp_size, node_size, slot_lens
        self.starts, self.lengths, self.owners = starts, lengths, owners
        by_rank = np.lexsort((starts, owners))
        offsets = lengths[by_rank].cumsum() - lengths[by_rank]  # rank-major index of each run's first token
        self.local_starts = np.empty_like(starts)
        self.local_starts[by_rank] = offsets - owners[by_rank] * (pack_len // cp_size)
        self._by_rank = by_rank
        self._rank_first = np.searchsorted(owners[by_rank], np.arange(cp_size + 1))

    @property
    def lens(self) -> np.ndarray:
        """int64 ``[D]``: the pack's slot lengths."""
        return self.slot_lens

    @property
    def doc(self) -> np.ndarray:
        """int64 ``[D]``: the slot of each document (``arange(D)``, as for the run tables)."""
        return np.arange(self.slot_lens.shape[0], dtype=np.int64)

    @property
    def doc_starts(self) -> np.ndarray:
        """int64 ``[D]``: global offset of each slot."""
        return self.slot_lens.cumsum() - self.slot_lens

    def row(self, rank: int, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len / cp]``: rank ``rank``'s positions in local order (increasing; into ``out``)."""
        at = self._by_rank[self._rank_first[rank] : self._rank_first[rank + 1]]
        if out is None:
            out = np.empty(self.pack_len // self.cp_size, dtype=np.int64)
        return segments(self.starts[at], self.lengths[at], out=out)

    def rows(self) -> np.ndarray:
        """int64 ``[cp, pack_len / cp]``: every rank's row."""
        return stacked_rows(self)

    def inverse(self, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len]``: ``inverse[g]`` = position of token ``g`` in the rank-major concatenation."""
        major = self.owners * (self.pack_len // self.cp_size) + self.local_starts
        if out is None:
            out = np.empty(self.pack_len, dtype=np.int64)
        return segments(major, self.lengths, out=out)

    def causal_work(self, real_lens: np.ndarray) -> np.ndarray:
        """float64 ``[cp]``: causal document-masked work per rank (a real token at slot offset ``o`` costs
        ``o + 1``, padding 0); ``real_lens`` int64 ``[>= D]``, the first ``D`` used."""
        lens = self.slot_lens
        real = np.asarray(real_lens, dtype=np.int64)[: lens.shape[0]]
        if lens.shape[0] == 0:
            return np.zeros(self.cp_size, dtype=np.float64)
        offsets = lens.cumsum() - lens
        k = np.maximum(offsets.searchsorted(self.starts, side="right") - 1, 0)  # a run lies in one slot
        lo = np.clip(self.starts - offsets[k], 0, real[k])
        hi = np.clip(self.starts + self.lengths - offsets[k], 0, real[k])
        return np.bincount(self.owners, (hi * (hi + 1) - lo * (lo + 1)) / 2, minlength=self.cp_size)


class WorldBlock:
    """The ``world`` layout of ``P`` packs: the :class:`~cpdata.layout.runs.RunBlock` interface
    (:meth:`tables`, :meth:`causal_work`, :meth:`doc_counts`)."""

    __slots__ = ("_tables",)

    def __init__(self, tables: list[WorldTable]) -> None:
        self._tables = tables

    def tables(self) -> list[WorldTable]:
        """One :class:`WorldTable` per pack."""
        return list(self._tables)

    def doc_counts(self) -> list[int]:
        """Slots of each pack (what :meth:`causal_work` takes a real length for)."""
        return [t.slot_lens.shape[0] for t in self._tables]

    def causal_work(self, real: np.ndarray) -> np.ndarray:
        """float64 ``[P, cp]``; ``real`` int64 ``[N]``: real tokens of each slot, pack after pack."""
        bounds = np.cumsum([0, *self.doc_counts()])
        return np.stack([t.causal_work(real[bounds[p] : bounds[p + 1]]) for p, t in enumerate(self._tables)])


def world_block(lens: np.ndarray, counts: np.ndarray | None, pack_len: int, cp_size: int, node_size: int,
                tile: int = 128) -> WorldBlock:  # fmt: skip
    """``world`` tables of ``P`` packs (``lens`` int64 ``[N]`` checked slot lengths, ``counts`` int64 ``[P]``
    slots per pack, None: one pack): one :func:`~cpdata.layout.world_deal.world_runs` per pack."""
    packs = [lens] if counts is None else np.split(lens, np.cumsum(counts)[:-1])
    return WorldBlock([WorldTable(p, pack_len, cp_size, node_size, *world_runs(p, pack_len, cp_size, node_size, tile))
                       for p in packs])  # fmt: skip
