"""The world step packer: ``StreamPlan(world_step=G)`` under a ``world`` layout packs ``G`` micro-batches at a time.

Pieces go, longest first within each window (ties by key), into one open step of ``G`` world micro-batches
(:class:`~cpdata.layout.world_step.StepBins`); a piece the step keeps for balance or cannot hold waits. The
step closes when the waiting pieces hold at least its free room (it is as full as balance lets it be), at the
end of the stream, and never otherwise: its ``G`` packs leave together, in micro-batch order, each piece with
its owners (:attr:`PackKeys.owners`), and the waiting pieces open the next step. The end of the stream closes
steps until nothing waits, leaving out their empty micro-batches.

Closing, the step's loads are exact (pad included), and the deal is finished on them:

0. a micro-batch left empty takes the longest waiting piece
   (:meth:`~cpdata.layout.world_step.StepBins.open_empty`); where that piece spreads, each of its widths whose
   busiest load is within :data:`EMPTY_TRIAL` of the least is closed to the end (phases 1-8) on a copy of the
   step, and the step keeps the one whose busiest rank ends least over the mean: the settle moves whole pieces,
   not spread ones, so the least loaded width before it is not always the least after it (a mix of chats and
   ~30K-token documents at 32 x 4K, seed 1: a 99,215-token document on 30 of 32 ranks left the other two at 0.62
   x the mean, the step at 1.054 x the mean rank; on 32 ranks, settled, 1.007 x);
1. top up: waiting pieces go where they keep their rank at or under the busiest one (:meth:`StepBins.top_up`);
2. settle (:class:`_Settle`): every rank above the mean load, busiest first, swaps its dearest whole pieces for
   cheaper ones of similar length on the least loaded ranks (the step keeps its tokens), then moves a piece to
   a lighter rank with room, else swaps it for a waiting piece that fits its place and adds fewer tiles, while
   that saves more than the tokens it leaves out would cost (the longer one waits instead);
3. then every rank still above the mean swaps a dear piece for several of the cheapest per token of one
   micro-batch of a light rank, as few as make room for it: a light rank full of short pieces has no piece of
   a long one's length to trade (sft 16 x 8K, seed 1: 1.016 -> 1.002 x the mean rank, 1.003 -> 0.989 x
   Megatron's busiest);
4. top up again, under the settled ceiling;
5. while the busiest rank still stands above the mean the top-up left, steps 2-4 again, up to three times more
   (:data:`SETTLE_PASSES`);
6. where the settle moved a micro-batch's last pieces away and pieces wait, the empty micro-batch is offered to
   them and steps 1-5 run once more (:data:`EMPTY_OFFERS`);
7. fill, where the step stands over the mean (:data:`SPREAD_SWAP_OVER`): waiting spread pieces, longest first
   (:data:`FILL_TRIES`), go where they leave the busiest rank less over the mean rank, past the level, clearing
   whole pieces from the room they need (:meth:`~cpdata.layout.world_step.StepBins.fill`,
   :meth:`WorldStepPacker._fill`): a step opened by a document on every rank, whose next ones of that size wait,
   otherwise closes with its other micro-batches part empty and its busiest ranks those of the few spread pieces
   it holds (a mixed corpus at 32 x 4K, seed 4: fill 0.37, 1.037 x the mean rank; filled, 0.83 and 1.010 x);
   where one is placed, the step closes (phases 1-2, 8) both with and without the fill and keeps the one that ends
   less over the mean (:meth:`WorldStepPacker._keep_filled`);
8. spread pieces inside a node trade windows (:class:`_SpreadSwap`): the settle moves whole pieces only, and a
   step whose tokens are mostly documents on 2-4 ranks has few (documents of 1-32K tokens, uniform, at 16 x 8K,
   seed 1: 1.056 x the mean rank; trading windows, 1.030 x), and where no trade lowers the busiest rank, one of
   its spread pieces moves to a free window, as many ranks or more inside its node (:meth:`_SpreadSwap._move`);
   then a top-up; while the busiest rank stands over the mean, the settle, a top-up and the trades run again, up
   to :data:`SWAP_PASSES` passes in all, each kept only where it ends the step less over the mean
   (:meth:`WorldStepPacker._kept_if_lower`); last, a spread piece of the busiest rank is taken back and placed
   again as the fill places, clearing whole pieces from its room, under the busiest load
   (:meth:`WorldStepPacker._refill`: a move finds no room where short pieces fill every micro-batch of the light
   ranks), up to :data:`REFILL_ROUNDS` times; and a piece of the busiest rank in a micro-batch with a rank left
   empty spreads over more ranks than a node in THD's chunks, as Megatron's scheduler widens a sample into the
   ranks it left empty (:meth:`WorldStepPacker._spread_out`), up to :data:`SPREAD_OUT_ROUNDS` times.

Phases 1-5 only lower the busiest rank or add tokens under it, and so do phase 8's trades and moves (its later
passes settle, and are kept where they end less over the mean); phases 0 and 6 add a waiting piece's work to a
micro-batch that would otherwise run empty, and phase 7 to a step it leaves less over its mean. The settle is
bounded (:data:`EXCHANGE_PIECES` pieces against :data:`EXCHANGE_NEAR` neighbours in length on
:data:`EXCHANGE_RANKS` ranks, at most :data:`EXCHANGE_ROUNDS` exchanges a rank), and so is the close: at most
:data:`EMPTY_OFFERS` rounds, each trial of phase 0 one close, phase 7 at most two.

Trade-off: a step holds up to ``G`` packs of pieces in the worker until it closes, and packs are not filled to
the token (the pad that lets a busy rank carry less); the per-rank sums it balances are the step time only
when the trainer accumulates ``G`` micro-batches a step and ranks move K/V point to point
(docs/benchmarks.md). The state is the open step's pieces in placement order with their owners, and the
waiting pieces: a resume deals the same steps.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from collections.abc import Callable, Sequence

import numpy as np

from cpdata.layout.spread import megatron_width, spread_chunks
from cpdata.layout.world_plan import alone_tiles
from cpdata.layout.world_step import FILL_RECEIVE_CAP, Placement, StepBins, owner_ranks
from cpdata.packing.records import PackKeys

__all__ = ["WorldStepPacker"]


SETTLE_PIECES = 64
"""Settling a rank moves or swaps out at most its this many dearest whole pieces."""

EXCHANGE_PIECES, EXCHANGE_RANKS, EXCHANGE_NEAR, EXCHANGE_ROUNDS = 24, 4, 8, 4
"""Settling a rank by exchange looks at its pieces adding most tiles, against the pieces nearest in length
on the least loaded ranks, for at most this many exchanges a rank."""

SETTLE_PASSES, SETTLE_AGAIN = 4, 0.01
"""Settle and top up at most this many times, again only while the busiest rank stands more than this fraction
above the mean: each settles to the mean the one before left (the pieces it sent back to wait and the top-up
that replaced them lowered it; web 32 x 4K, seed 5: 1.012 -> 1.004 x the mean rank from two passes to four; a
step that runs them all pays up to half again its solve, docs/benchmarks.md; alpaca's steps, at the mean after
one, pay nothing for them)."""

EMPTY_TRIAL = 0.01
"""A spread piece filling an empty micro-batch at close tries its widths whose busiest load is within this
fraction of the least (:meth:`WorldStepPacker._close`)."""

EMPTY_OFFERS = 2
"""Closing, the waiting pieces are offered the micro-batches left empty at most this many times: a settle that
moves a micro-batch's last pieces into fuller ones leaves it empty (a mix of chats and ~30K-token documents at
16 x 8K, seed 9: four of eight, the step at fill 0.35 and 1.044 x the mean rank; offered again, 0.67 and
1.012 x)."""

SPREAD_SWAP_OVER = 0.005
"""Closing, spread pieces trade windows (:class:`_SpreadSwap`) while the busiest rank stands more than this
fraction over the mean."""

SWAP_PASSES = 3
"""Closing, spread pieces trade windows at most this many times, each time after the first following a settle and a
top-up, and kept only where it ends the step less over the mean (:meth:`WorldStepPacker._trade`): a trade or move
that lowers the busiest rank can leave whole pieces the settle then moves (documents of 7,800-8,600 tokens at 32 x
4K, seed 3: 1.105 x the mean rank after one pass, 1.039 x after three; docs/benchmarks.md, "Your own corpus")."""

REFILL_ROUNDS = 4
"""Closing, at most this many spread pieces of the busiest rank are placed again (:meth:`WorldStepPacker._refill`)."""

SPREAD_OUT_ROUNDS, SPREAD_OUT_OVER = 4, 0.001
"""Closing, at most this many pieces of the busiest rank spread over ranks left empty, while the busiest rank stands
more than this fraction over the mean (:meth:`WorldStepPacker._spread_out`: it looks only at micro-batches with an
empty rank, so a step within :data:`SPREAD_SWAP_OVER` of its mean pays little for it)."""

FILL_TRIES, FILL_MISSES = 8, 2
"""Closing, at most this many waiting spread pieces, longest first, are tried in the step's room, and none after
this many in a row are not kept (:meth:`WorldStepPacker._fill`): each is a placement search over its widths and a
trial on a copy of the step."""

MANY_ROUNDS = 8
"""Then at most this many exchanges a rank of one dear piece for several cheap ones (of its
:data:`EXCHANGE_PIECES` dearest, on the :data:`EXCHANGE_RANKS` least loaded ranks)."""


def _over(load: Sequence[float], fraction: float) -> bool:
    """Whether the busiest of ``load`` stands more than ``fraction`` above their mean."""
    return max(load) > (1 + fraction) * sum(load) / len(load)


def _ratio(load: Sequence[float]) -> float:
    """The busiest of ``load`` over their mean (inf where nothing is loaded)."""
    total = sum(load)
    return max(load) * len(load) / total if total > 0 else float("inf")


def _longest_first(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(key, length)`` pieces longest first, ties by key (two stable sorts: no key tuple a piece)."""
    out = sorted(pieces, key=operator.itemgetter(0))
    out.sort(key=operator.itemgetter(1), reverse=True)
    return out


class WorldStepPacker:
    """Steps of ``packs`` world micro-batches of ``capacity`` tokens over ``world`` ranks (the module docstring);
    a :class:`~cpdata.packing.planner.BinPacker` whose packs carry owners."""

    carries = True

    def __init__(self, capacity: int, world: int, node_size: int, packs: int, tile: int = 128) -> None:
        self.capacity, self.world, self.node_size, self.packs, self.tile = capacity, world, node_size, packs, tile
        self._bins = self._new_step()
        self._step: list[tuple[int, int, Placement]] = []  # (key, slot, where), in placement order
        self._waiting: list[tuple[int, int]] = []  # (key, slot)

    def _new_step(self) -> StepBins:
        return StepBins(self.packs, self.world, self.capacity // self.world, self.node_size, self.tile)

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        pending = self._waiting + list(zip(keys.tolist(), slots.tolist(), strict=True))
        closed = []
        while True:
            self._waiting = self._deal(_longest_first(pending))
            if not self._waiting or sum(s for _, s in self._waiting) < self._bins.free_tokens:
                return PackKeys.concat(closed)
            closed.append(self._close(keep_empty=True))  # (tops up from self._waiting)
            pending = self._waiting

    def finish(self) -> PackKeys:
        closed = []
        while self._step:
            closed.append(self._close(keep_empty=False))
            self._waiting = self._deal(_longest_first(self._waiting))
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
            best: tuple[float, tuple[StepBins, list, list]] | None = None
            for choice in trials:
                before = self._saved()
                self._finish(choice)
                load = self._bins.load
                over = max(load) * len(load) / sum(load)  # (trials may end holding different pieces)
                if best is None or over < best[0]:
                    best = (over, self._saved())
                self._bins, self._step, self._waiting = before
            self._bins, self._step, self._waiting = best[1]
        else:  # (the one width, or None: what the offer would choose, not searched for again)
            self._finish(trials[0] if trials else None)
        keys = np.fromiter((key for key, _, _ in self._step), dtype=np.int64, count=len(self._step))
        where = np.array([where for _, _, where in self._step], dtype=np.int64).reshape(-1, 3)
        order = np.lexsort((keys, where[:, 0]))  # micro-batch after micro-batch, keys ascending in each
        sizes = np.bincount(where[:, 0], minlength=self.packs)
        self._step, self._bins = [], self._new_step()
        return PackKeys(keys=keys[order], sizes=sizes if keep_empty else sizes[sizes > 0],
                        owners=where[order, 1:])  # fmt: skip

    def _finish(self, choice: tuple[float, int, int, int] | None) -> None:
        """The closing phases: the first waiting piece spread at ``choice`` (None: as the rest) into the empty
        micro-batch, the waiting pieces offered to the micro-batches left empty, then the top-up and the
        settle passes, again where those left a micro-batch empty; last, spread pieces trade windows and a
        top-up fills what that freed (the module docstring)."""
        if choice is not None:
            key, s = self._waiting.pop(0)
            self._step.append((key, s, self._bins.open_empty(s, choice)))
        for _ in range(EMPTY_OFFERS):
            self._waiting = self._offer(self._waiting, self._bins.open_empty)
            self._top_up()
            for done in range(SETTLE_PASSES):
                if done and not _over(self._bins.load, SETTLE_AGAIN):
                    break
                self._settle()
                self._top_up()
            if not self._waiting or self._bins.first_empty() is None:
                break
        fill = _over(self._bins.load, SPREAD_SWAP_OVER) and any(s > self._bins.local for _, s in self._waiting)
        unfilled = self._saved() if fill else None  # (a balanced step pays nothing)
        if unfilled is None or not self._fill():
            self._trade()
            return
        self._top_up()
        self._settle()
        self._top_up()
        self._trade()
        filled = (_ratio(self._bins.load), self._saved())
        self._bins, self._step, self._waiting = unfilled
        self._trade()
        if self._keep_filled(filled[0], _ratio(self._bins.load)):
            self._bins, self._step, self._waiting = filled[1]

    @staticmethod
    def _keep_filled(filled: float, unfilled: float) -> bool:
        """Whether the close keeps the step its fill (:meth:`_fill`) ended at ``filled`` over the mean rank, against
        ``unfilled`` without it: where that is less (the settle after the fill can end further over the mean than
        the step without it: the near2L corpus at 32 x 4K, seed 1, 1.071 -> 1.148 x, docs/benchmarks.md)."""
        return filled < unfilled

    def _trade(self) -> None:
        """Spread pieces trade windows and a top-up fills what that freed; again, up to :data:`SWAP_PASSES` times
        in all, after a settle, where the step stays over the mean and each pass ends it less over the mean (a
        pass that does not is undone)."""
        for again in range(SWAP_PASSES):
            if not _over(self._bins.load, SPREAD_SWAP_OVER):  # (a balanced step pays nothing)
                break
            if not again:
                self._swap()
            elif not self._kept_if_lower(self._settle_and_swap):
                break
        self._refill()
        self._spread_out()

    def _spread_out(self) -> None:
        """While the step stands over the mean (:data:`SPREAD_OUT_OVER`), at most :data:`SPREAD_OUT_ROUNDS` times: a
        piece the busiest rank holds part of, in a micro-batch with a rank left empty, is placed again over more
        ranks than a node and than Megatron's power of two, in THD's chunks, as Megatron's scheduler widens a
        sample into the ranks it left empty (:func:`~cpdata.layout.spread.spread_chunks`), where that leaves its
        busiest rank under the busiest rank, no rank receiving more keys, or more keys from other nodes, than the
        step's busiest receivers or :data:`~cpdata.layout.world_step.FILL_RECEIVE_CAP` times the mean rank's (the
        fill's cap), and the step less over the mean (:meth:`_kept_if_lower`). A step of
        world-sized pieces whose last holds a short document alone, on its 2 ranks (books at 32 x 4K, seed 3:
        1.0039 x the mean rank, Megatron's busiest 1.0004 x its own, the short document over all 32)."""
        for _ in range(SPREAD_OUT_ROUNDS):
            load = self._bins.load
            if not _over(load, SPREAD_OUT_OVER):
                return
            found = self._spread_out_place(max(range(len(load)), key=lambda r: (load[r], -r)))
            if found is None or not self._kept_if_lower(functools.partial(self._place_again, *found)):
                return

    def _spread_out_place(self, h: int) -> tuple[int, Placement] | None:
        """``(piece, placement)``: :meth:`_spread_out`'s choice for busiest rank ``h``; None where none."""
        b = self._bins
        emptied = {k for k in range(b.packs) if any(room[k] == b.local for room in b.room)}
        if not emptied:  # (most steps: nothing to look at)
            return None
        top, inter = b.load[h], self._inter_keys()
        top_recv = max(max(b.recv), FILL_RECEIVE_CAP * sum(b.recv) / b.world)
        top_inter = max(max(inter), FILL_RECEIVE_CAP * sum(inter) / b.world)
        best: tuple[float, int, Placement] | None = None
        for i, (_, s, (k, first, c)) in enumerate(self._step):
            if k not in emptied or h not in owner_ranks(first, c):
                continue
            widths = [w for w in range(2 * b.node_size, b.world + 1, b.node_size) if w > abs(c)]
            if not widths:
                continue
            (b.take_back if c == 1 else b.take_back_spread)(s, (k, first, c))
            arrays = b._arrays()
            for w in widths:
                choice = b._choose(s, w, top_recv, arrays=arrays)
                if choice is None or choice[0] >= top or (best is not None and choice[0] >= best[0]):
                    continue
                where = choice[1:]
                after = list(inter)
                for r, keys in self._inter_of(s, (k, first, c)).items():
                    after[r] -= keys
                for r, keys in self._inter_of(s, where).items():
                    after[r] += keys
                if max(after) <= top_inter:
                    best = (choice[0], i, where)
            b.restore(s, (k, first, c))
        return None if best is None else (best[1], best[2])

    def _place_again(self, i: int, where: Placement) -> None:
        """Piece ``i`` of the step taken back and placed at ``where``."""
        key, s, old = self._step[i]
        (self._bins.take_back if old[2] == 1 else self._bins.take_back_spread)(s, old)
        self._bins.restore(s, where)
        self._step[i] = (key, s, where)

    def _inter_keys(self) -> list[int]:
        """Per rank, the keys it receives from other nodes over the step."""
        inter = [0] * self.world
        for _, s, where in self._step:
            for r, keys in self._inter_of(s, where).items():
                inter[r] += keys
        return inter

    def _inter_of(self, s: int, where: Placement) -> dict[int, int]:
        """Keys each rank of a piece of ``s`` tokens at ``where`` receives from ranks of other nodes: role ``j``
        needs every chunk up to its later one, ``2c - 1 - j``, so of role ``q`` its chunk ``q``, and its chunk
        ``2c - 1 - q`` where ``q > j`` (:func:`~cpdata.layout.spread.chunk_recv`)."""
        _, first, c = where
        ranks = list(owner_ranks(first, c))
        ns = self.node_size
        if ranks[0] // ns == ranks[-1] // ns:
            return {}
        chunk = spread_chunks(s, abs(c), self.capacity // self.world, ns)
        last = 2 * abs(c) - 1
        return {r: sum(chunk[q] + (chunk[last - q] if q > j else 0)
                       for q, rq in enumerate(ranks) if rq // ns != r // ns) for j, r in enumerate(ranks)}

    def _refill(self) -> None:
        """While the step stands over the mean (:data:`SPREAD_SWAP_OVER`), at most :data:`REFILL_ROUNDS` times: of
        the spread pieces inside a node the busiest rank holds part of, longest first, the first that, taken back
        and placed inside a node (its keys cross no node: placed again across nodes, a piece lifted the step's
        busiest inter-node receiver past Megatron's, the exponential corpus at 32 x 4K, seed 4, 1.03 x) where
        :meth:`StepBins.fill` chooses (clearing whole pieces from the room it needs, as the fill does:
        a move, :meth:`_SpreadSwap._move`, finds no room where whole pieces fill every micro-batch of the light
        ranks) under the busiest rank's load, leaves the step less over the mean and its tokens no fewer (its busiest
        load is the step's time: held only to less over the mean, a wider cut's dearer tiles would pass for a gain,
        and the busiest rank could rise)."""
        for _ in range(REFILL_ROUNDS):
            load = self._bins.load
            if not _over(load, SPREAD_SWAP_OVER):
                return
            h = max(range(len(load)), key=lambda r: (load[r], -r))
            held = sorted(((s, key, where) for key, s, where in self._step
                           if 1 < abs(where[2]) <= self.node_size and h in owner_ranks(where[1], where[2])),
                          reverse=True)  # fmt: skip
            whole, top = self._whole_slots(), max(load)  # (a spread piece taken back leaves them)
            for s, key, where in held:
                b = self._bins  # (a trial not kept puts back a copy)
                b.take_back_spread(s, where)
                found = b.fill(s, whole, top)  # (its busiest load under the busiest rank as it stood with it)
                b.restore(s, where)
                phase = functools.partial(self._refill_one, s, key, where, found)
                if found is not None and self._kept_if_lower(phase, False):  # (a look first: the trial copies)
                    break
            else:
                return

    def _refill_one(self, s: int, key: int, where: Placement, found: tuple[Placement, list[tuple[int, int]]]
                    ) -> None:  # fmt: skip
        """Take spread piece ``key`` of ``s`` tokens back from ``where`` and place it again where
        :meth:`StepBins.fill` found (:meth:`_fill_one`)."""
        self._step.remove((key, s, where))
        self._bins.take_back_spread(s, where)
        self._fill_one(key, s, found)

    def _swap(self) -> None:
        _SpreadSwap(self).run()
        self._top_up()

    def _settle_and_swap(self) -> None:
        self._settle()
        self._top_up()
        self._swap()

    def _kept_if_lower(self, phase: Callable[[], None], fewer_tokens: bool = True) -> bool:
        """Run ``phase`` on the step; undo it (False) where it leaves the busiest rank no less over the mean, or,
        unless ``fewer_tokens``, the step holding fewer tokens."""
        ratio, tokens, before = _ratio(self._bins.load), self._bins.placed, self._saved()
        phase()
        if _ratio(self._bins.load) < ratio and (fewer_tokens or self._bins.placed >= tokens):
            return True
        self._bins, self._step, self._waiting = before
        return False

    def _fill(self) -> bool:
        """Waiting spread pieces, longest first (:data:`FILL_TRIES`), go where they leave the step's busiest
        rank less over its mean (:meth:`StepBins.fill`), clearing whole pieces from the slots they need, which are
        dealt again where they keep their rank at or under the busiest (:meth:`StepBins.top_up`), else wait; each
        kept only where the step then stands less over the mean than before it and holds no fewer tokens (a dear
        piece in the place of cheap ones that wait lifts the mean: the step would do the same work in fewer
        tokens, its linear layers running more pad). Whether any was."""
        pending, self._waiting, waiting, tried, missed, placed = self._waiting, [], [], 0, 0, False
        whole = None  # (the whole pieces' slots, computed again once a fill is kept)
        for key, s in pending:
            if s <= self._bins.local or tried == FILL_TRIES or missed == FILL_MISSES:
                waiting.append((key, s))
                continue
            tried += 1
            whole = self._whole_slots() if whole is None else whole
            found = self._bins.fill(s, whole)  # (a look first: the trial copies the step)
            if found is not None and self._kept_if_lower(functools.partial(self._fill_one, key, s, found), False):
                whole, placed, missed = None, True, 0
            else:
                waiting.append((key, s))
                missed += 1
        self._waiting = _longest_first(waiting + self._waiting)
        return placed

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
        """Place piece ``key`` of ``s`` tokens where :meth:`StepBins.fill` found, on this step as it was then: the
        whole pieces of the slots it names leave first and are offered to :meth:`StepBins.top_up`; the rest
        wait."""
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
        self._waiting += self._offer(_longest_first(evicted), b.top_up)

    def _saved(self) -> tuple[StepBins, list[tuple[int, int, Placement]], list[tuple[int, int]]]:
        """A copy of the open step, its pieces and the waiting ones (a trial close changes them, not it)."""
        return self._bins.copy(), list(self._step), list(self._waiting)

    def _top_up(self) -> None:
        self._waiting = self._offer(self._waiting, self._bins.top_up)

    def _offer(self, pieces: Sequence[tuple[int, int]], place: Callable[[int], Placement | None]
               ) -> list[tuple[int, int]]:  # fmt: skip
        """Offer ``pieces`` to ``place``: the ones it places join the step; the others, in order, are returned."""
        waiting = []
        for key, s in pieces:
            where = place(s)
            if where is None:
                waiting.append((key, s))
            else:
                self._step.append((key, s, where))
        return waiting

    def _settle(self) -> None:
        """Bring every rank above the mean load down to it with the loads now exact (:class:`_Settle`)."""
        _Settle(self).run()

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


class _Settle:
    """A closing step's whole pieces rearranged so that no rank's load stays above the mean, busiest rank first:
    swap its dearest pieces with cheaper ones of similar length on the least loaded ranks (the step keeps its
    tokens), then move a piece to the least loaded rank with room that stays under the mean, else swap it for
    the longest waiting piece that fits its place and adds fewer tiles (it waits instead) while that saves the
    step more than the tokens it leaves out would cost a rank; then, busiest first again, swap a dear piece for
    several cheap ones of a light rank (:meth:`_exchange_many`)."""

    def __init__(self, packer: WorldStepPacker) -> None:
        self.packer, self.bins, self.step, self.tile = packer, packer._bins, packer._step, packer.tile
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
        waiting = self.packer._waiting
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


class _SpreadSwap:
    """Spread pieces inside one node trade windows: while the busiest rank stands more than
    :data:`SPREAD_SWAP_OVER` above the mean, of the spread pieces it holds part of and every other spread piece
    of as many ranks, the pair whose swapped placements (each takes the other's micro-batch, first rank and
    orientation) leave the busiest of their ranks least, where that is under the busiest rank's load, every
    rank keeps its room and none receives more keys than the step's busiest receiver; where no pair does, one of its
    pieces moves to a window, of its width or another inside its node, that does (:meth:`_move`); at most
    ``rounds`` swaps and moves.
    Inside a node no key crosses nodes, so the inter-node keys stay. Trade-off: each swap passes over the step's
    spread pieces once for every piece the busiest rank holds part of (docs/benchmarks.md measures the solve)."""

    def __init__(self, packer: WorldStepPacker) -> None:
        self.bins, self.step = packer._bins, packer._step
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
        load = self.bins.load
        for _ in range(rounds):
            busiest = max(range(len(load)), key=lambda r: (load[r], -r))
            if not _over(load, SPREAD_SWAP_OVER) or not self._lower(busiest):
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
            arrays = b._arrays()
            least = np.sort(arrays[1])  # (a window of c ranks holds one loaded at least as the c-th least)
            for c in range(-(-s // b.local), widest + 1):
                cut = b.cut(s, c)
                if cut is None or max(least[c - 1], least[0] + cut[1].max()) >= top:
                    continue  # (no window of this width can end under ``top``)
                choice = b._choose(s, c, top_recv, arrays=arrays)
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
