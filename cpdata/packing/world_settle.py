"""The settle of a closing world step: its whole pieces rearranged so that no rank's load stays above the mean.

Phases 2-3 of :mod:`cpdata.packing.world_steps`' close (:class:`Settle`): the deal places pieces one at a time
against projected loads; closing, the loads are exact, and the ranks above the mean, busiest first, swap their
dearest whole pieces for cheaper ones of similar length on the least loaded ranks, move them to lighter ranks with
room, swap them for waiting pieces that add fewer tiles, and last exchange a dear piece for several cheap ones of a
light rank. Spread pieces do not move here (:class:`~cpdata.packing.world_trades.SpreadSwap` trades them).
Trade-off: bounded work, :data:`EXCHANGE_PIECES` pieces against :data:`EXCHANGE_NEAR` neighbours in length on
:data:`EXCHANGE_RANKS` ranks, at most :data:`EXCHANGE_ROUNDS` exchanges a rank (:data:`MANY_ROUNDS` of one for
several), so a settle may stop short of the mean.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

from cpdata.layout.step_moves import StepMoves
from cpdata.layout.world_owners import Placement
from cpdata.layout.world_plan import alone_tiles

__all__ = ["EXCHANGE_NEAR", "EXCHANGE_PIECES", "EXCHANGE_RANKS", "EXCHANGE_ROUNDS", "MANY_ROUNDS", "SETTLE_PIECES",
           "Settle"]

SETTLE_PIECES = 64
"""Settling a rank moves or swaps out at most its this many dearest whole pieces."""

EXCHANGE_PIECES, EXCHANGE_RANKS, EXCHANGE_NEAR, EXCHANGE_ROUNDS = 24, 4, 8, 4
"""Settling a rank by exchange looks at its pieces adding most tiles, against the pieces nearest in length
on the least loaded ranks, for at most this many exchanges a rank."""

MANY_ROUNDS = 8
"""Then at most this many exchanges a rank of one dear piece for several cheap ones (of its
:data:`EXCHANGE_PIECES` dearest, on the :data:`EXCHANGE_RANKS` least loaded ranks)."""


class Settle:
    """A closing step's whole pieces rearranged so that no rank's load stays above the mean, busiest rank first:
    swap its dearest pieces with cheaper ones of similar length on the least loaded ranks (the step keeps its
    tokens), then move a piece to the least loaded rank with room that stays under the mean, else swap it for
    the longest waiting piece that fits its place and adds fewer tiles (it waits instead) while that saves the
    step more than the tokens it leaves out would cost a rank; then, busiest first again, swap a dear piece for
    several cheap ones of a light rank (:meth:`_exchange_many`)."""

    def __init__(self, bins: StepMoves, step: list[tuple[int, int, Placement]], waiting: list[tuple[int, int]]
                 ) -> None:  # fmt: skip
        self.bins, self.step, self.waiting, self.tile = bins, step, waiting, bins.tile
        bins = self.bins
        self.level = sum(bins.load) / bins.world
        self.cost = [alone_tiles(s, self.tile) if c == 1 else 0.0 for _, s, (_, _, c) in self.step]
        self.length = [s for _, s, _ in self.step]  # (kept as the step's pieces change)
        self._length = self.length.__getitem__
        # each rank's whole pieces (indices into the step), by (length, index) and by (-cost, index)
        self.by_size: list[list[int]] = [[] for _ in range(bins.world)]
        for i, (_, _, (_, first, c)) in enumerate(self.step):
            if c == 1:
                self.by_size[first].append(i)
        self.by_cost = [sorted(mine, key=self.cost.__getitem__, reverse=True) for mine in self.by_size]
        self._cheap: dict[int, list[tuple[list[int], list[int], list[float]]]] = {}  # _cheap_first's, per rank
        for mine in self.by_size:
            mine.sort(key=self._length)

    def _add(self, r: int, i: int) -> None:
        self._cheap.pop(r, None)
        bisect.insort(self.by_size[r], i, key=lambda j: (self.length[j], j))
        bisect.insort(self.by_cost[r], i, key=lambda j: (-self.cost[j], j))

    def _drop(self, r: int, i: int) -> None:
        self._cheap.pop(r, None)
        self.by_size[r].remove(i)
        self.by_cost[r].remove(i)

    def run(self) -> None:
        bins, level, step = self.bins, self.level, self.step
        waiting = self.waiting
        sizes = sorted({s for _, s in waiting if s <= bins.local})
        pool: dict[int, list[int]] = {}
        for key, s in sorted(waiting, reverse=True):
            pool.setdefault(s, []).append(key)  # (pop() takes the least key)
        for h in self._busiest_first():
            if bins.load[h] <= level:
                break
            self._lower(h, EXCHANGE_ROUNDS, self._exchange)
            for i in self.by_cost[h][:SETTLE_PIECES]:
                if bins.load[h] <= level:
                    break
                key, s, (k, _, _) = step[i]
                added = self.cost[i]
                moved = bins.move(s, (k, h, 1), level)
                if moved is not None:
                    self._drop(h, i)
                    step[i] = (key, s, moved)
                    self._add(moved[1], i)
                    continue
                at = bisect.bisect_right(sizes, s + bins.room[h][k])
                w = next((sizes[j] for j in range(at - 1, max(at - 64, 0) - 1, -1) if pool.get(sizes[j])
                          and alone_tiles(sizes[j], self.tile) < added), 0)  # fmt: skip
                gain = added - alone_tiles(w, self.tile) if w else 0.0
                over = bins.load[h] - level
                if w and gain <= 2 * over and min(gain, over) > (gain + (s - w) / self.tile) / bins.world:
                    bins.take_back(s, (k, h, 1))
                    bins.restore(w, (k, h, 1))
                    self._drop(h, i)
                    wkey = pool[w].pop()
                    step[i] = (wkey, w, (k, h, 1))
                    self.length[i] = w
                    self.cost[i] = alone_tiles(w, self.tile)
                    self._add(h, i)
                    waiting.remove((wkey, w))
                    waiting.append((key, s))
        for h in self._busiest_first():
            if bins.load[h] <= level:
                break
            self._lower(h, MANY_ROUNDS, self._exchange_many)

    def _busiest_first(self) -> list[int]:
        load = self.bins.load
        return sorted(range(self.bins.world), key=lambda r: (-load[r], r))

    def _lower(self, h: int, rounds: int, exchange: Callable[[int], bool]) -> None:
        """At most ``rounds`` exchanges of rank ``h``'s pieces while it stays above the mean."""
        for _ in range(rounds):
            if self.bins.load[h] <= self.level or not exchange(h):
                break

    def _cheap_first(self, q: int) -> list[tuple[list[int], list[int], list[float]]]:
        """Per micro-batch of rank ``q``: its whole pieces cheapest per token first (ties: by index), and the
        running sums of their lengths and tiles (kept until ``q``'s pieces change)."""
        if q not in self._cheap:
            step, cost, length = self.step, self.cost, self.length
            groups: list[list[int]] = [[] for _ in range(self.bins.packs)]
            for j in self.by_size[q]:
                groups[step[j][2][0]].append(j)
            out = []
            for g in groups:
                g.sort(key=lambda j: (cost[j] / length[j], j))
                out.append((g, list(itertools.accumulate((length[j] for j in g), initial=0)),
                            list(itertools.accumulate((cost[j] for j in g), initial=0.0))))  # fmt: skip
            self._cheap[q] = out
        return self._cheap[q]

    def _exchange_many(self, h: int) -> bool:
        """Swap a dear piece of rank ``h`` for two or more of the cheapest pieces per token of one micro-batch of
        a rank under the mean, as few as make room for it (and fit where it was), the swap that leaves the busier
        of the two least loaded; False where none lowers ``h``. (A rank full of short pieces sits under the
        mean with no room: no piece of similar length costs what a long one does, :meth:`_exchange`.)"""
        bins, step, cost = self.bins, self.step, self.cost
        load, room = bins.load, bins.room
        mine = self.by_cost[h][:EXCHANGE_PIECES]
        lows = sorted((r for r in range(bins.world) if load[r] < self.level), key=lambda r: (load[r], r))
        lh = load[h]
        if not lows or lh - load[lows[0]] < 2:  # (whole tiles move: h comes down only 2 or more over a rank)
            return False
        best, pick = lh, None
        for q in lows[:EXCHANGE_RANKS]:
            lq = load[q]
            for m, (group, lengths, costs) in enumerate(self._cheap_first(q)):
                if len(group) < 2:
                    continue
                free = room[q][m]
                for i in mine:
                    s, k = step[i][1], step[i][2][0]
                    n = bisect.bisect_left(lengths, s - free)
                    if n < 2 or n == len(lengths) or lengths[n] > s + room[h][k]:
                        continue
                    gain = cost[i] - costs[n]
                    after = lh - gain if lh - gain > lq + gain else lq + gain
                    if gain > 0 and after < best:
                        best, pick = after, (i, q, m, group[:n])
        if pick is None:
            return False
        i, q, m, theirs = pick
        key, s, (k, _, _) = step[i]
        self._drop(h, i)
        bins.take_back(s, (k, h, 1))
        for j in theirs:
            self._drop(q, j)
            bins.take_back(self.length[j], (m, q, 1))
        bins.restore(s, (m, q, 1))
        step[i] = (key, s, (m, q, 1))
        self._add(q, i)
        for j in theirs:
            bins.restore(self.length[j], (k, h, 1))
            step[j] = (step[j][0], self.length[j], (k, h, 1))
            self._add(h, j)
        return True

    def _exchange(self, h: int) -> bool:
        """Swap a piece of rank ``h`` for a cheaper one of similar length on a rank under the mean, the pair that
        leaves the busier of the two least loaded; False where none lowers ``h``."""
        bins, step, cost = self.bins, self.step, self.cost
        load, room = bins.load, bins.room
        mine = self.by_cost[h][:EXCHANGE_PIECES]
        lows = sorted((r for r in range(bins.world) if load[r] < self.level), key=lambda r: (load[r], r))
        lh = load[h]
        best, best_i, best_j = lh, -1, -1
        for q in lows[:EXCHANGE_RANKS]:
            theirs, lq, widest, room_q = self.by_size[q], load[q], bins.best_room[q], room[q]
            for i in mine:
                s, k, dear = step[i][1], step[i][2][0], cost[i]
                at = bisect.bisect_left(theirs, s, key=self._length)
                lo = max(bisect.bisect_left(theirs, s - widest, key=self._length), at - EXCHANGE_NEAR)
                hi = min(bisect.bisect_right(theirs, s + room[h][k], key=self._length), at + EXCHANGE_NEAR)
                for j in theirs[lo:hi]:
                    u = step[j][1]
                    gain = dear - cost[j]
                    if gain <= 0:
                        continue
                    after = lh - gain if lh - gain > lq + gain else lq + gain
                    if after < best and s <= u + room_q[step[j][2][0]]:
                        best, best_i, best_j = after, i, j
        if best_i < 0:
            return False
        i, j = best_i, best_j
        (key, s, (k, _, _)), (ukey, u, (ku, q, _)) = step[i], step[j]
        self._drop(h, i)
        self._drop(q, j)
        bins.take_back(s, (k, h, 1))
        bins.take_back(u, (ku, q, 1))
        bins.restore(u, (k, h, 1))
        bins.restore(s, (ku, q, 1))
        step[i], step[j] = (key, s, (ku, q, 1)), (ukey, u, (k, h, 1))
        self._add(h, j)
        self._add(q, i)
        return True
