"""The moves the close makes on an open step's books, beside the deal's own placing (:mod:`~cpdata.layout.world_step`).

The deal places each piece once, as it comes (:meth:`StepBins.place`); when the step closes
(:mod:`cpdata.packing.world_close`), its phases move what is already placed and place what waited under other
rules than the deal's: a waiting piece goes where it costs the step nothing (:meth:`StepMoves.top_up`), a whole
piece moves to a lighter rank (:meth:`StepMoves.move`, the settle's), and a piece that waited past the level
opens a micro-batch left empty (:meth:`StepMoves.open_empty`), at a width the packer may try
(:meth:`StepMoves.empty_widths`). Each keeps the books exact (:class:`~cpdata.layout.step_loads.StepLoads`), as
the deal does.
"""

from __future__ import annotations

import math
import operator

from cpdata.layout.spread import megatron_width
from cpdata.layout.world_owners import Placement
from cpdata.layout.world_plan import alone_tiles
from cpdata.layout.world_step import StepBins

__all__ = ["StepMoves"]


class StepMoves(StepBins):
    """An open step's deal (:class:`~cpdata.layout.world_step.StepBins`) with the close's moves: what the packer
    builds. Deterministic, as the deal."""

    __slots__ = ()

    def top_up(self, s: int) -> Placement | None:
        """Place a whole piece where it keeps its rank at or under the busiest rank's load (it then costs the
        step nothing and fills pad): the least loaded rank with room; None where none can."""
        if s > self.local:
            return None
        added = alone_tiles(s, self.tile)
        r = self._lightest(s, self._by_load[-1][0] - added, -1)
        if r < 0:
            return None
        k = self._best_fit(r, s)
        self._take(r, k, s, added)
        return k, r, 1

    def open_empty(self, s: int, choice: tuple[float, int, int, int] | None = None) -> Placement | None:
        """Place a piece of ``s`` tokens, past the level, into the first micro-batch no rank holds anything of:
        whole on the least loaded rank, or spread at ``choice`` (one of :meth:`empty_widths`; default its first:
        the width and window whose busiest load after it is least, ties the fewest ranks); None when every
        micro-batch holds something (a step leaves none empty while pieces wait). On its fewest ranks a long
        piece that waited past the level would fill the empty micro-batch on those ranks alone (a mixed corpus at
        16 x 8K, seed 6: a 75,162-token document on 10 of 16 ranks, the step 1.26 x the mean rank; on 16,
        1.00 x)."""
        k = self.first_empty()
        if k is None or s > self.world * self.local:
            return None
        if s <= self.local:
            r = self._by_load[0][1]
            self._take(r, k, s, alone_tiles(s, self.tile))
            return k, r, 1
        return self._take_choice(s, choice if choice is not None else next(iter(self.empty_widths(s)), None))

    def empty_widths(self, s: int, within: float = 0.0) -> list[tuple[float, int, int, int]]:
        """:meth:`choose`'s placements of a spread piece of ``s`` tokens in the first empty micro-batch, one a
        width from its fewest ranks up to the power of two Megatron's scheduler would give it, whose busiest load
        after it is within ``within`` (a fraction) of the least: least first (ties: the fewest ranks). Empty
        where no micro-batch is empty or the piece fits a rank."""
        k, c = self.first_empty(), -(-s // self.local)
        if k is None or c == 1 or c > self.world:
            return []
        widths = range(c, min(self.world, megatron_width(s, self.local)) + 1)
        choices = sorted((best for best in self.choose_widths(s, widths, math.inf, k) if best is not None),
                         key=operator.itemgetter(0))  # (sorted keeps the first of equals: the fewest ranks)
        return [best for best in choices if best[0] <= choices[0][0] * (1 + within)]

    def move(self, s: int, where: Placement, level: float) -> Placement | None:
        """Move a whole piece of ``s`` tokens from ``where`` to the least loaded other rank with room that it
        keeps at or under ``level`` (into its micro-batch of least room that fits); None (unmoved) where none."""
        added = alone_tiles(s, self.tile)
        r = self._lightest(s, level - added, where[1])
        if r < 0:
            return None
        self.take_back(s, where)
        k = self._best_fit(r, s)
        self._take(r, k, s, added)
        return k, r, 1
