"""Spread pieces trading windows inside a node, for a closing world step.

Phase 8 of :mod:`cpdata.packing.world_steps`' close (:class:`SpreadSwap`): the settle moves whole pieces only, so a
step whose tokens are mostly documents on 2-4 ranks keeps the deal's imbalance; here a spread piece of the busiest
rank trades windows with another of as many ranks, or moves to a free window of any width inside its node. Inside
a node no key crosses nodes, so the inter-node keys stay what they were. Trade-off: each trade passes over the
step's spread pieces once for every piece the busiest rank holds part of (docs/benchmarks.md measures the solve).
"""

from __future__ import annotations

from cpdata.layout.spread import megatron_width
from cpdata.layout.world_owners import Placement, owner_ranks
from cpdata.layout.world_step import StepBins

__all__ = ["SPREAD_SWAP_OVER", "SpreadSwap"]

SPREAD_SWAP_OVER = 0.005
"""Closing, spread pieces trade windows (:class:`SpreadSwap`) while the busiest rank stands more than this
fraction over the mean."""


class SpreadSwap:
    """Spread pieces inside one node trade windows: while the busiest rank stands more than
    :data:`SPREAD_SWAP_OVER` above the mean, of the spread pieces it holds part of and every other spread piece
    of as many ranks, the pair whose swapped placements (each takes the other's micro-batch, first rank and
    orientation) leave the busiest of their ranks least, where that is under the busiest rank's load, every
    rank keeps its room and none receives more keys than the step's busiest receiver; where no pair does, one of its
    pieces moves to a window, of its width or another inside its node, that does (:meth:`_move`); at most
    ``rounds`` swaps and moves.
    Inside a node no key crosses nodes, so the inter-node keys stay. Trade-off: each swap passes over the step's
    spread pieces once for every piece the busiest rank holds part of (docs/benchmarks.md measures the solve)."""

    def __init__(self, bins: StepBins, step: list[tuple[int, int, Placement]]) -> None:
        self.bins, self.step = bins, step
        b = self.bins
        # per spread piece inside a node (its index in the step): its roles' tokens, tiles and keys. A trade or a
        # move changes where a piece is, not its width: its ranks are read from the step (:meth:`_ranks`)
        self.roles: dict[int, tuple[list[int], list[float], list[int]]] = {}
        for i, (_, s, (_, _, c)) in enumerate(self.step):
            if 2 <= abs(c) <= b.node_size:
                need, tiles, keys = b.roles(s, abs(c))
                self.roles[i] = (need.tolist(), tiles.tolist(), keys.tolist())

    def _ranks(self) -> dict[int, list[int]]:
        """Each spread piece's ranks in role order, where the step places it now."""
        return {i: list(owner_ranks(self.step[i][2][1], self.step[i][2][2])) for i in self.roles}

    def run(self, rounds: int = 16) -> None:
        """Trade while the busiest rank stands over the mean and a trade lowers it, at most ``rounds`` times."""
        for _ in range(rounds):
            if not self.bins.over(SPREAD_SWAP_OVER) or not self._lower(self.bins.busiest_rank()):
                return

    def _lower(self, h: int) -> bool:
        """Make the best trade of a spread piece rank ``h`` holds part of (the class docstring); False where none
        leaves the ranks it changes under ``h``'s load."""
        b, step, roles, ranks = self.bins, self.step, self.roles, self._ranks()
        load, recv, room = b.load, b.recv, b.room
        top, top_recv = load[h], max(recv)
        best: tuple[float, int, int] | None = None
        for i, (ni, ti, ri) in roles.items():
            ranks_i = ranks[i]
            if h not in ranks_i:
                continue
            xh, ci, mi = ranks_i.index(h), len(ranks_i), step[i][2][0]
            for j, (nj, tj, rj) in roles.items():
                ranks_j = ranks[j]
                if len(ranks_j) != ci or tj[xh] >= ti[xh] or ranks_j == ranks_i:
                    continue
                # j's window takes i's roles: each of its ranks must stay under the busiest rank
                if any(load[ranks_j[x]] - tj[x] + ti[x] >= top for x in range(ci)):
                    continue
                delta: dict[int, float] = {}
                keys: dict[int, int] = {}
                for x in range(ci):
                    a, q = ranks_i[x], ranks_j[x]
                    delta[a] = delta.get(a, 0.0) - ti[x] + tj[x]
                    delta[q] = delta.get(q, 0.0) - tj[x] + ti[x]
                    keys[a] = keys.get(a, 0) - ri[x] + rj[x]
                    keys[q] = keys.get(q, 0) - rj[x] + ri[x]
                after = max(load[r] + d for r, d in delta.items())
                if after >= top or (best is not None and after >= best[0]):
                    continue
                if any(recv[r] + d > top_recv for r, d in keys.items()):
                    continue
                mj = step[j][2][0]
                free: dict[tuple[int, int], int] = {}
                for x in range(ci):
                    free[(ranks_i[x], mi)] = free.get((ranks_i[x], mi), room[ranks_i[x]][mi]) + ni[x]
                    free[(ranks_j[x], mj)] = free.get((ranks_j[x], mj), room[ranks_j[x]][mj]) + nj[x]
                for x in range(ci):
                    free[(ranks_j[x], mj)] -= ni[x]
                    free[(ranks_i[x], mi)] -= nj[x]
                if min(free.values()) < 0:
                    continue
                best = (after, i, j)
        if best is None:
            return self._move(h)
        _, i, j = best
        (key_i, s_i, where_i), (key_j, s_j, where_j) = step[i], step[j]
        b.take_back_spread(s_i, where_i)
        b.take_back_spread(s_j, where_j)
        b.restore(s_i, where_j)
        b.restore(s_j, where_i)
        step[i], step[j] = (key_i, s_i, where_j), (key_j, s_j, where_i)
        return True

    def _move(self, h: int) -> bool:
        """Where no trade lowers rank ``h``: move one of the spread pieces it holds part of to the window inside a
        node (any micro-batch with room, either orientation, any width from its fewest ranks up to the node's or
        twice Megatron's power of two, whichever is fewer: past that power of two in the receive-capped cut, as an
        opening piece may go, :meth:`~cpdata.layout.world_step.StepBins._spread`) that leaves the busiest of its
        ranks least, where that is under ``h``'s load and no rank receives more keys than the step's busiest
        receiver; False (nothing changed) where none does. A narrower window costs fewer tiles, a wider one fewer
        a rank (the mixed corpus at 32 x 4K, seed 14: an 11,263-token document on 4 ranks at 979 tiles each beside
        a 100,472-token one on all 32; on 7, at most 688)."""
        b, step = self.bins, self.step
        top, top_recv = b.load[h], max(b.recv)
        best: tuple[float, int, tuple[float, int, int, int]] | None = None
        for i, ranks_i in self._ranks().items():
            if h not in ranks_i:
                continue
            _, s, where = step[i]
            widest = min(b.node_size, b.world, 2 * megatron_width(s, b.local))
            b.take_back_spread(s, where)
            widths = b.widths_under(s, range(-(-s // b.local), widest + 1), top, strict=True)
            for choice in b.choose_widths(s, widths, top_recv):
                if choice is not None and choice[0] < top and (best is None or choice[0] < best[0]):
                    best = (choice[0], i, choice)
            b.restore(s, where)
        if best is None:
            return False
        _, i, (_, k, first, c) = best
        key, s, where = step[i]
        b.take_back_spread(s, where)
        b.restore(s, (k, first, c))
        step[i] = (key, s, (k, first, c))
        if abs(c) != len(self.roles[i][0]):
            need, tiles, keys = b.roles(s, abs(c))
            self.roles[i] = (need.tolist(), tiles.tolist(), keys.tolist())
        return True
