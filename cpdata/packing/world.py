"""The world packer: each pack is one world micro-batch planned as ``W`` per-rank bins of ``S / W`` tokens.

Under a ``world`` layout the decreasing packers (``bfd``, the default, and ``ffd``) pack with
:class:`WorldPacker`: first-fit-decreasing over each window, a pack taking a piece only when its bins
(:class:`~cpdata.layout.world_plan.WorldBins`) hold it whole (at most ``L = S / W`` tokens) or, for a longer
piece, on ``ceil(s / L)`` consecutive ranks of one node. The deal replays the bins from the slot lengths, so
no document is cut to fill a rank; the price is packs not filled to the last token.

Carry (``bfd``): the :data:`CARRY` emptiest packs of a window with a quarter rank of room go back to the next
window, packed again with its pieces, unless they hold a piece :data:`MAX_AGE` windows old (``ffd`` emits
every pack). Cost: a loop over the open packs per piece, a heap over the ranks per short piece and a scan of
rank windows per long one (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.layout.world_plan import WorldBins
from cpdata.packing.decreasing import decreasing, packs_by_bin
from cpdata.packing.greedy import OpenBins
from cpdata.packing.records import PackKeys

__all__ = ["CARRY", "MAX_AGE", "WorldPacker"]

CARRY = 2
"""Packs kept open between windows (``bfd``), the emptiest with room for a short piece."""

MAX_AGE = 16
"""A carried pack holding a piece older than this many windows' pieces (counted in keys) is emitted."""


class WorldPacker(OpenBins):
    """First-fit-decreasing of each window into world micro-batches of ``world`` bins of ``capacity / world``
    tokens (``node_size`` ranks per node); ``carry=True``: the :data:`CARRY` emptiest packs' pieces go back to
    the next window."""

    def __init__(self, capacity: int, world: int, node_size: int, tile: int = 128, *, carry: bool = True) -> None:
        self.world, self.node_size, self.tile = world, node_size, tile
        self.keep = CARRY if carry else 0
        super().__init__(capacity)

    def _fill(self, keys: np.ndarray, slots: np.ndarray) -> list[tuple[list[int], list[int], WorldBins]]:
        """First-fit of the pieces, longest first (ties by key), into new packs: ``(keys, slots, bins)`` each."""
        ks, ss = decreasing(keys, slots)
        local = self.capacity // self.world
        packs: list[tuple[list[int], list[int], WorldBins]] = []
        for key, s in zip(ks.tolist(), ss.tolist(), strict=True):
            for pk, ps, bins in packs:
                if (s <= local and s > bins.max_room) or s > bins.total_room or bins.place(s) is None:
                    continue
                pk.append(key)
                ps.append(s)
                break
            else:
                bins = WorldBins(local, self.world, self.node_size, self.tile)
                if bins.place(s) is None:
                    raise ValueError(f"a piece of {s} tokens does not fit a world micro-batch of {self.world} x "
                                     f"{local} tokens; pack with overflow='split' or 'truncate'")  # fmt: skip
                packs.append(([key], [s], bins))
        return packs

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        n = int(keys.shape[0])
        _, ck, cs = self.carry_columns()
        packs = self._fill(np.concatenate([ck, keys]), np.concatenate([cs, slots]))
        oldest = int(keys.min()) - MAX_AGE * n
        short = self.capacity // self.world // 4
        open_ = [i for i, (pk, _, bins) in enumerate(packs) if bins.max_room >= short and min(pk) >= oldest]
        kept = set(sorted(open_, key=lambda i: (-packs[i][2].total_room, min(packs[i][0])))[: self.keep])
        self.load_carry([(packs[i][0], packs[i][1]) for i in sorted(kept)])
        return self._emit([p for i, p in enumerate(packs) if i not in kept])

    @staticmethod
    def _emit(packs: list) -> PackKeys:
        flat = np.array([k for p in packs for k in p[0]], dtype=np.int64)
        bin_of = np.repeat(np.arange(len(packs), dtype=np.int64), [len(p[0]) for p in packs])
        return packs_by_bin(flat, bin_of)

    def finish(self) -> PackKeys:
        packs = self._fill(*self.carry_columns()[1:])
        self.load_carry([])
        return self._emit(packs)

    def load_carry(self, bins: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        if bins and not self.keep:
            raise ValueError("the world packer under 'ffd' carries nothing between windows, but the state holds "
                             "open packs; restore it under the packing algorithm it was saved with")  # fmt: skip
        super().load_carry(bins)
