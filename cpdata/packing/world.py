"""The world packer: each pack is one world micro-batch planned as ``W`` per-rank bins of ``S / W`` tokens.

Under a ``world`` layout (``"world"`` / ``"world:8"``, :mod:`cpdata.layout.world`) the decreasing packers
(``bfd``, the default, and ``ffd``) pack with :class:`WorldPacker`: first-fit-decreasing over each window
where a pack takes a piece only when the plan's bins (:class:`~cpdata.layout.world_plan.WorldBins`) have room
for it whole (at most ``L = S / W`` tokens) or, for a longer piece, on ``ceil(s / L)`` consecutive ranks of
one node. The deal (:func:`~cpdata.layout.world_deal.world_runs`) replays the same bins from the pack's slot
lengths, so no document is cut to fill a rank and the short ones receive no keys; the price is packs that
are not filled to the last token (pad is free in the layout half, and every rank keeps ``L`` positions).

Nothing is carried between windows (like ``ffd``); with ``window=None`` the window is the whole stream.
Cost: a Python loop over the open packs per piece (packs whose emptiest rank cannot hold a short piece, or
too few of whose ranks can hold a long piece's share, are skipped after one check), a heap over the ranks per
short piece and a scan of rank windows per long one; a stream of long documents (many open packs, each tried
for each long piece) costs the most per document.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.layout.world_plan import WorldBins
from cpdata.packing.decreasing import decreasing, packs_by_bin
from cpdata.packing.records import PackKeys

__all__ = ["WorldPacker"]


class WorldPacker:
    """First-fit-decreasing of each window into world micro-batches of ``world`` bins of ``capacity / world``
    tokens (``node_size`` ranks per node); nothing is carried between windows."""

    def __init__(self, capacity: int, world: int, node_size: int, tile: int = 128) -> None:
        self.capacity, self.world, self.node_size, self.tile = capacity, world, node_size, tile

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        if keys.shape[0] == 0:
            return PackKeys.concat([])
        ks, ss = decreasing(keys, slots)
        packs: list[WorldBins] = []
        bin_of: list[int] = []
        local = self.capacity // self.world
        for s in ss.tolist():
            at = -1
            for p, bins in enumerate(packs):
                if (s <= local and s > bins.max_room) or s > bins.max_room * self.world:
                    continue
                if bins.place(s) is not None:
                    at = p
                    break
            if at < 0:
                bins = WorldBins(local, self.world, self.node_size, self.tile)
                if bins.place(s) is None:
                    raise ValueError(f"a piece of {s} tokens does not fit a world micro-batch of {self.world} x "
                                     f"{local} tokens; pack with overflow='split' or 'truncate'")  # fmt: skip
                packs.append(bins)
                at = len(packs) - 1
            bin_of.append(at)
        return packs_by_bin(ks, np.asarray(bin_of, dtype=np.int64))

    def finish(self) -> PackKeys:
        return PackKeys.concat([])

    def carry(self) -> list[tuple[list[int], list[int]]]:
        return []

    def load_carry(self, bins: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        if bins:
            raise ValueError("the world packer carries nothing between windows, but the state holds open bins; "
                             "restore it under the packing algorithm it was saved with")  # fmt: skip
