"""The open world step (:class:`OpenStep`): its books, its pieces and the waiting ones, and the moves every phase of
its close (:mod:`cpdata.packing.world_close`) makes on them.

A step is three things that change together: the books (:class:`~cpdata.layout.step_moves.StepMoves`: each
rank's room, load and keys per micro-batch), the pieces placed, in placement order, each ``(key, tokens, (micro-batch,
first rank, ranks))``, and the pieces that wait, ``(key, tokens)``. A trial of the close copies all three
(:meth:`OpenStep._saved`) and puts the copy back (:meth:`OpenStep._restore`) where the trial is not kept
(:meth:`OpenStep._kept_if_lower`).

The state a resume restores is the same three: the placed pieces with their owners rebuild the books
(:meth:`OpenStep.load_carry`), so a resume deals the same steps.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import numpy as np

from cpdata.layout.step_moves import StepMoves
from cpdata.layout.world_owners import Placement
from cpdata.layout.world_plan import alone_tiles
from cpdata.packing.world_keys import InterNodeKeys
from cpdata.packing.world_settle import Settle

__all__ = ["OpenStep", "longest_first"]


def longest_first(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(key, length)`` pieces longest first, ties by key (two stable sorts: no key tuple a piece)."""
    out = sorted(pieces, key=operator.itemgetter(0))
    out.sort(key=operator.itemgetter(1), reverse=True)
    return out


class OpenStep:
    """One open step of ``packs`` world micro-batches of ``capacity`` tokens over ``world`` ranks, ``node_size``
    ranks a node: the books, the placed pieces and the waiting ones (the module docstring)."""

    def __init__(self, capacity: int, world: int, node_size: int, packs: int, tile: int = 128) -> None:
        self.capacity, self.world, self.node_size, self.packs, self.tile = capacity, world, node_size, packs, tile
        self._bins = self._new_step()
        self._step: list[tuple[int, int, Placement]] = []  # (key, slot, where), in placement order
        self._waiting: list[tuple[int, int]] = []  # (key, slot)
        self._crossing = InterNodeKeys(world, capacity // world, node_size)

    def _new_step(self) -> StepMoves:
        return StepMoves(self.packs, self.world, self.capacity // self.world, self.node_size, self.tile)

    def _saved(self) -> tuple[StepMoves, list[tuple[int, int, Placement]], list[tuple[int, int]]]:
        """A copy of the open step, its pieces and the waiting ones (a trial close changes them, not it)."""
        return self._bins.copy(), list(self._step), list(self._waiting)

    def _restore(self, saved: tuple[StepMoves, list[tuple[int, int, Placement]], list[tuple[int, int]]]) -> None:
        """Put back a :meth:`_saved` copy as the open step (the copy becomes the step: save again to reuse it)."""
        self._bins, self._step, self._waiting = saved

    def _kept_if_lower(self, phase: Callable[[], None], fewer_tokens: bool = True) -> bool:
        """Run ``phase`` on the step; undo it (False) where it leaves the busiest rank no less over the mean, or,
        unless ``fewer_tokens``, the step holding fewer tokens."""
        ratio, tokens, before = self._bins.ratio(), self._bins.placed, self._saved()
        phase()
        if self._bins.ratio() < ratio and (fewer_tokens or self._bins.placed >= tokens):
            return True
        self._restore(before)
        return False

    def _offer(self, pieces: Sequence[tuple[int, int]], place: Callable[[int], Placement | None],
               spent: Callable[[], bool] | None = None) -> list[tuple[int, int]]:  # fmt: skip
        """Offer ``pieces`` to ``place``: the ones it places join the step; the others, in order, are returned.
        ``spent``: asked after a refusal, True where ``place`` can take nothing more until a piece is placed (the
        rest are then returned without an offer each: a close offers a few hundred)."""
        waiting: list[tuple[int, int]] = []
        for i, (key, s) in enumerate(pieces):
            where = place(s)
            if where is not None:
                self._step.append((key, s, where))
                continue
            waiting.append((key, s))
            if spent is not None and spent():
                waiting += pieces[i + 1 :]
                break
        return waiting

    def _offer_empty(self) -> None:
        """Offer the waiting pieces to the micro-batches left empty
        (:meth:`~cpdata.layout.step_moves.StepMoves.open_empty`), until none is."""
        self._waiting = self._offer(self._waiting, self._bins.open_empty, lambda: self._bins.first_empty() is None)

    def _top_up(self) -> None:
        self._waiting = self._offer(self._waiting, self._bins.top_up)

    def _settle(self) -> None:
        """Bring every rank above the mean load down to it with the loads now exact (:class:`Settle`)."""
        Settle(self._bins, self._step, self._waiting).run()

    def _whole_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """float64 ``[world, packs]`` each: the tokens and tiles of the whole pieces on each rank and micro-batch."""
        b = self._bins
        tokens, tiles = np.zeros((b.world, b.packs)), np.zeros((b.world, b.packs))
        where = np.array([w for _, _, w in self._step], dtype=np.int64).reshape(-1, 3)
        lengths = np.fromiter((s for _, s, _ in self._step), dtype=np.int64, count=len(self._step))
        one = where[:, 2] == 1
        np.add.at(tokens, (where[one, 1], where[one, 0]), lengths[one])
        np.add.at(tiles, (where[one, 1], where[one, 0]), alone_tiles(lengths[one], b.tile))  # (each, at once)
        return tokens, tiles

    def _fill_one(self, key: int, s: int, found: tuple[Placement, list[tuple[int, int]]]) -> None:
        """Place piece ``key`` of ``s`` tokens where :func:`fill_place` found, on this step as it was then: the
        whole pieces of the slots it names leave first and are offered to
        :meth:`~cpdata.layout.step_moves.StepMoves.top_up`; the rest wait."""
        b = self._bins
        where, slots = found
        cleared, step, evicted = set(slots), [], []
        for piece in self._step:
            _, length, (k, r, c) = piece
            if c == 1 and (r, k) in cleared:
                b.take_back(length, piece[2])
                evicted.append(piece[:2])
            else:
                step.append(piece)
        b.restore(s, where)
        self._step = [*step, (key, s, where)]
        self._waiting += self._offer(longest_first(evicted), b.top_up)

    def _place_again(self, i: int, where: Placement) -> None:
        """Piece ``i`` of the step taken back and placed at ``where``."""
        key, s, old = self._step[i]
        self._bins.remove(s, old)
        self._bins.restore(s, where)
        self._step[i] = (key, s, where)

    def _inter_keys(self) -> list[int]:
        """Per rank, the keys it receives from other nodes over the step (:class:`InterNodeKeys`)."""
        return self._crossing.per_rank(self._step)

    # state: bin 0 the open step's pieces in placement order (owners: carry_owners), bin 1 the waiting ones
    def carry_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        keys = [k for k, _, _ in self._step] + [k for k, _ in self._waiting]
        slots = [s for _, s, _ in self._step] + [s for _, s in self._waiting]
        offsets = np.array([0, len(self._step), len(keys)], dtype=np.int64)
        return offsets, np.array(keys, dtype=np.int64), np.array(slots, dtype=np.int64)

    def carry_owners(self) -> np.ndarray:
        """int64 ``[pieces, 3]``: the open step's placements ``(micro-batch, first rank, ranks)``, in order."""
        return np.array([where for _, _, where in self._step], dtype=np.int64).reshape(-1, 3)

    def load_carry(self, bins: Sequence[tuple[Sequence[int], Sequence[int]]], owners: np.ndarray | None = None
                   ) -> None:  # fmt: skip
        placed, waiting = (list(bins) + [([], []), ([], [])])[:2]
        if len(bins) > 2 or (len(placed[0]) and (owners is None or len(owners) != len(placed[0]))):
            raise ValueError(f"a world step state holds the open step's pieces with their owners and the waiting "
                             f"ones: got {len(bins)} bins and owners for "
                             f"{0 if owners is None else len(owners)} of {len(placed[0])} placed pieces; restore it "
                             "under the configuration it was saved with")  # fmt: skip
        self._bins, self._step = self._new_step(), []
        for key, s, where in zip(placed[0], placed[1], [] if owners is None else owners.tolist(), strict=True):
            self._bins.restore(int(s), tuple(where))
            self._step.append((int(key), int(s), tuple(where)))
        self._waiting = [(int(k), int(s)) for k, s in zip(*waiting, strict=True)]
