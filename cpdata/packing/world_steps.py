"""The world step packer: ``StreamPlan(world_step=G)`` under a ``world`` layout packs ``G`` micro-batches at a time.

Pieces go, longest first within each window (ties by key), into one open step of ``G`` world micro-batches
(:class:`~cpdata.layout.world_step.StepBins`); a piece the step keeps for balance or cannot hold waits. The
step closes when the waiting pieces hold at least its free room (it is as full as balance lets it be), at the
end of the stream, and never otherwise: its ``G`` packs leave together, in micro-batch order, each piece with
its owners (:attr:`PackKeys.owners`), and the waiting pieces open the next step. The end of the stream closes
steps until nothing waits, leaving out their empty micro-batches.

Closing, the step's loads are exact (pad included), and the deal is finished on them:

0. a micro-batch left empty takes the longest waiting piece
   (:meth:`~cpdata.layout.step_moves.StepMoves.open_empty`); where that piece spreads, each of its widths whose
   busiest load is within :data:`EMPTY_TRIAL` of the least is closed to the end (phases 1-10) on a copy of the
   step, and the step keeps the one whose busiest rank ends least over the mean: the settle moves whole pieces,
   not spread ones, so the least loaded width before it is not always the least after it (a mix of chats and
   ~30K-token documents at 32 x 4K, seed 1: a 99,215-token document on 30 of 32 ranks left the other two at 0.62
   x the mean, the step at 1.054 x the mean rank; on 32 ranks, settled, 1.007 x);
1-10. the top-ups, the settle, the fill, the trades, the mirrors and densify
   (:class:`~cpdata.packing.world_close.StepClose`, whose module lists them in order).

The close is bounded: at most :data:`~cpdata.packing.world_close.EMPTY_OFFERS` rounds of offers, each trial of
phase 0 one close, the fill's at most two.

Trade-off: a step holds up to ``G`` packs of pieces in the worker until it closes, and packs are not filled to
the token (the pad that lets a busy rank carry less); the per-rank sums it balances are the step time only
when the trainer accumulates ``G`` micro-batches a step and ranks move K/V point to point
(docs/benchmarks.md). The state is the open step's pieces in placement order with their owners, and the
waiting pieces: a resume deals the same steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.layout.step_moves import StepMoves
from cpdata.packing.open_step import longest_first
from cpdata.packing.records import PackKeys
from cpdata.packing.world_close import StepClose

__all__ = ["EMPTY_TRIAL", "WorldStepPacker"]


EMPTY_TRIAL = 0.01
"""A spread piece filling an empty micro-batch at close tries its widths whose busiest load is within this
fraction of the least (:meth:`WorldStepPacker._close`)."""


class WorldStepPacker(StepClose):
    """Steps of ``packs`` world micro-batches of ``capacity`` tokens over ``world`` ranks (the module docstring);
    a :class:`~cpdata.packing.planner.BinPacker` whose packs carry owners. The open step and its state are
    :class:`~cpdata.packing.open_step.OpenStep`'s, the close's phases
    :class:`~cpdata.packing.world_close.StepClose`'s."""

    carries = True

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        pending = self._waiting + list(zip(keys.tolist(), slots.tolist(), strict=True))
        closed = []
        while True:
            self._waiting = self._deal(longest_first(pending))
            if not self._waiting or sum(s for _, s in self._waiting) < self._bins.free_tokens:
                return PackKeys.concat(closed)
            closed.append(self._close(keep_empty=True))  # (tops up from self._waiting)
            pending = self._waiting

    def finish(self) -> PackKeys:
        closed = []
        while self._step:
            closed.append(self._close(keep_empty=False))
            self._waiting = self._deal(longest_first(self._waiting))
        if self._waiting:  # (nothing waits once a step is empty: a fresh step takes any piece)
            raise AssertionError(f"{len(self._waiting)} pieces left after the last step")
        return PackKeys.concat(closed)

    def _deal(self, pieces: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Deal ``pieces`` into the open step; the ones that wait."""
        lengths = [s for _, s in pieces]
        self._bins.set_density(lengths)
        waiting = []
        for (key, s), where in zip(pieces, self._bins.deal(lengths), strict=True):
            if where is None:
                if not self._step and s > self.capacity:
                    raise ValueError(f"a piece of {s} tokens does not fit a world micro-batch of {self.world} x "
                                     f"{self.capacity // self.world} tokens; pack with overflow='split'")  # fmt: skip
                waiting.append((key, s))
            else:
                self._step.append((key, s, where))
        return waiting

    def _close(self, keep_empty: bool) -> PackKeys:
        """The open step's packs (keys ascending in each, with their owners), first topped up, settled and topped
        up again (the module docstring); a fresh step opens. A micro-batch nothing was dealt to first takes the
        longest waiting piece (past the level: an empty micro-batch would cost every rank a pass for nothing);
        where that piece spreads, each of its widths within :data:`EMPTY_TRIAL` of the least busiest load is
        tried on a copy of the step, closed to the end, and the one whose step ends with its busiest rank least
        over the mean rank is kept (ties: the first tried): the settle moves whole pieces, not spread ones, so
        the width least loaded before it is not always least after it. (Over the mean, not the busiest load
        alone: the top-ups and a micro-batch offered again can leave the trials holding different pieces, and
        one holding less work would win by it.)"""
        trials = self._bins.empty_widths(self._waiting[0][1], EMPTY_TRIAL) if self._waiting else []
        if len(trials) > 1:
            best: tuple[float, tuple[StepMoves, list, list]] | None = None
            for choice in trials:
                before = self._saved()
                self._finish(choice)
                over = self._bins.ratio()  # (over the mean: trials may end holding different pieces)
                if best is None or over < best[0]:
                    best = (over, self._saved())
                self._restore(before)
            self._restore(best[1])
        else:  # (the one width, or None: what the offer would choose, not searched for again)
            self._finish(trials[0] if trials else None)
        keys = np.fromiter((key for key, _, _ in self._step), dtype=np.int64, count=len(self._step))
        where = np.array([where for _, _, where in self._step], dtype=np.int64).reshape(-1, 3)
        order = np.lexsort((keys, where[:, 0]))  # micro-batch after micro-batch, keys ascending in each
        sizes = np.bincount(where[:, 0], minlength=self.packs)
        self._step, self._bins = [], self._new_step()
        return PackKeys(keys=keys[order], sizes=sizes if keep_empty else sizes[sizes > 0],
                        owners=where[order, 1:])  # fmt: skip
