"""The close of an open world step (:class:`StepClose`, :mod:`cpdata.packing.open_step`): the step's loads are now
exact (pad included), and the deal is finished on them. The packer (:mod:`cpdata.packing.world_steps`) runs phase 0
(a micro-batch left empty takes the longest waiting piece, its widths tried) and then these, in order:

1. top up: waiting pieces go where they keep their rank at or under the busiest one
   (:meth:`~cpdata.layout.step_moves.StepMoves.top_up`);
2. settle (:class:`Settle`): every rank above the mean load, busiest first, swaps its dearest whole pieces for
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
   whole pieces from the room they need (:func:`~cpdata.packing.world_fill.fill_place`,
   :meth:`StepClose._fill`): a step opened by a document on every rank, whose next ones of that size wait,
   otherwise closes with its other micro-batches part empty and its busiest ranks those of the few spread pieces
   it holds (a mixed corpus at 32 x 4K, seed 4: fill 0.37, 1.037 x the mean rank; filled, 0.83 and 1.010 x);
   where one is placed, the step closes (phases 1-2, 8) both with and without the fill and keeps the one that ends
   less over the mean (:meth:`StepClose._keep_filled`);
8. spread pieces inside a node trade windows (:class:`SpreadSwap`): the settle moves whole pieces only, and a
   step whose tokens are mostly documents on 2-4 ranks has few (documents of 1-32K tokens, uniform, at 16 x 8K,
   seed 1: 1.056 x the mean rank; trading windows, 1.030 x), and where no trade lowers the busiest rank, one of
   its spread pieces moves to a free window, as many ranks or more inside its node (:meth:`SpreadSwap._move`);
   then a top-up; while the busiest rank stands over the mean, the settle, a top-up and the trades run again, up
   to :data:`SWAP_PASSES` passes in all, each kept only where it ends the step less over the mean
   (:meth:`StepClose._kept_if_lower`); last, a spread piece of the busiest rank is taken back and placed
   again as the fill places, clearing whole pieces from its room, under the busiest load
   (:meth:`StepClose._refill`: a move finds no room where short pieces fill every micro-batch of the light
   ranks), up to :data:`REFILL_ROUNDS` times; and a piece of the busiest rank in a micro-batch with a rank left
   empty spreads over more ranks than a node in THD's chunks, as Megatron's scheduler widens a sample into the
   ranks it left empty (:meth:`StepClose._spread_out`), up to :data:`SPREAD_OUT_ROUNDS` times;
9. spread pieces the busiest receiver of keys holds part of are mirrored where that lowers it, then the same for
   the busiest receiver of keys from other nodes, lifting no rank past the busiest load or either busiest
   receiver (:meth:`StepClose._flip`);
10. densify (:class:`~cpdata.packing.world_densify.Densify`): ranks under the busiest take dearer waiting pieces
    (whole, or spread inside a node under the step's busiest receiver of keys) in place of cheaper whole ones, at
    or under the busiest load, clearing past a piece's own tokens no more than the pad they leave costs
    (:data:`~cpdata.packing.world_densify.PAD_TILES`); the pieces cleared are topped up or wait. The step's time
    stays; later steps are left less work.

Phases 1-5 only lower the busiest rank or add tokens under it, and so do phase 8's trades and moves (its later passes
settle, and are kept where they end less over the mean); phases 0 and 6 add a waiting piece's work to a micro-batch
that would otherwise run empty, and phase 7 to a step it leaves less over its mean; phase 9 only lowers receivers, and
phase 10 only raises ranks under the busiest. The settle is bounded (:mod:`~cpdata.packing.world_settle`), and so is
the close: at most :data:`EMPTY_OFFERS` rounds, each trial of phase 0 one close, phase 7 at most two.

"""

from __future__ import annotations

import functools

from cpdata.layout.world_owners import Placement, owner_ranks
from cpdata.packing.open_step import OpenStep, longest_first
from cpdata.packing.world_densify import Densify
from cpdata.packing.world_fill import fill_place
from cpdata.packing.world_keys import mirror_choice, spread_out_choice
from cpdata.packing.world_trades import SPREAD_SWAP_OVER, SpreadSwap

__all__ = ["EMPTY_OFFERS", "FILL_MISSES", "FILL_TRIES", "FLIP_ROUNDS", "REFILL_ROUNDS", "SETTLE_AGAIN", "SETTLE_PASSES",
           "SPREAD_OUT_OVER", "SPREAD_OUT_ROUNDS", "SWAP_PASSES", "StepClose"]  # fmt: skip


SETTLE_PASSES, SETTLE_AGAIN = 4, 0.01
"""Settle and top up at most this many times, again only while the busiest rank stands more than this fraction
above the mean: each settles to the mean the one before left (the pieces it sent back to wait and the top-up
that replaced them lowered it; web 32 x 4K, seed 5: 1.012 -> 1.004 x the mean rank from two passes to four; a
step that runs them all pays up to half again its solve, docs/benchmarks.md; alpaca's steps, at the mean after
one, pay nothing for them)."""


EMPTY_OFFERS = 2
"""Closing, the waiting pieces are offered the micro-batches left empty at most this many times: a settle that
moves a micro-batch's last pieces into fuller ones leaves it empty (a mix of chats and ~30K-token documents at
16 x 8K, seed 9: four of eight, the step at fill 0.35 and 1.044 x the mean rank; offered again, 0.67 and
1.012 x)."""

SWAP_PASSES = 3
"""Closing, spread pieces trade windows at most this many times, each time after the first following a settle and a
top-up, and kept only where it ends the step less over the mean (:meth:`StepClose._trade`): a trade or move
that lowers the busiest rank can leave whole pieces the settle then moves (documents of 7,800-8,600 tokens at 32 x
4K, seed 3: 1.105 x the mean rank after one pass, 1.039 x after three; docs/benchmarks.md, "Your own corpus")."""

REFILL_ROUNDS = 4
"""Closing, at most this many spread pieces of the busiest rank are placed again (:meth:`StepClose._refill`)."""

FLIP_ROUNDS = 8
"""Closing, at most this many spread pieces are mirrored to lower the step's busiest receiver, and as many its busiest
inter-node receiver (:meth:`StepClose._flip`)."""

SPREAD_OUT_ROUNDS, SPREAD_OUT_OVER = 4, 0.001
"""Closing, at most this many pieces of the busiest rank spread over ranks left empty, while the busiest rank stands
more than this fraction over the mean (:meth:`StepClose._spread_out`: it looks only at micro-batches with an
empty rank, so a step within :data:`SPREAD_SWAP_OVER` of its mean pays little for it)."""

FILL_TRIES, FILL_MISSES = 8, 2
"""Closing, at most this many waiting spread pieces, longest first, are tried in the step's room, and none after
this many in a row are not kept (:meth:`StepClose._fill`): each is a placement search over its widths and a
trial on a copy of the step."""


class StepClose(OpenStep):
    """The phases that close an open step (the module docstring), each a method on the step's books, its pieces
    and the waiting ones; :meth:`_finish` runs them in order."""

    def _finish(self, choice: tuple[float, int, int, int] | None) -> None:
        """The closing phases: the first waiting piece spread at ``choice`` (None: as the rest) into the empty
        micro-batch, the waiting pieces offered to the micro-batches left empty, then the top-up and the
        settle passes, again where those left a micro-batch empty; last, spread pieces trade windows and a
        top-up fills what that freed (the module docstring)."""
        if choice is not None:
            key, s = self._waiting.pop(0)
            self._step.append((key, s, self._bins.open_empty(s, choice)))
        for _ in range(EMPTY_OFFERS):
            self._offer_empty()
            self._top_up()
            for done in range(SETTLE_PASSES):
                if done and not self._bins.over(SETTLE_AGAIN):
                    break
                self._settle()
                self._top_up()
            if not self._waiting or self._bins.first_empty() is None:
                break
        fill = self._bins.over(SPREAD_SWAP_OVER) and any(s > self._bins.local for _, s in self._waiting)
        unfilled = self._saved() if fill else None  # (a balanced step pays nothing)
        if unfilled is None or not self._fill():
            self._trade()
            return
        self._top_up()
        self._settle()
        self._top_up()
        self._trade()
        filled = (self._bins.ratio(), self._saved())
        self._restore(unfilled)
        self._trade()
        if self._keep_filled(filled[0], self._bins.ratio()):
            self._restore(filled[1])

    @staticmethod
    def _keep_filled(filled: float, unfilled: float) -> bool:
        """Whether the close keeps the step its fill (:meth:`_fill`) ended at ``filled`` over the mean rank, against
        ``unfilled`` without it: where that is less (the settle after the fill can end further over the mean than
        the step without it: the near2L corpus at 32 x 4K, seed 1, 1.071 -> 1.148 x, docs/benchmarks.md)."""
        return filled < unfilled

    def _fill(self) -> bool:
        """Waiting spread pieces, longest first (:data:`FILL_TRIES`), go where they leave the step's busiest
        rank less over its mean (:func:`fill_place`), clearing whole pieces from the slots they need, which are
        dealt again where they keep their rank at or under the busiest
        (:meth:`~cpdata.layout.step_moves.StepMoves.top_up`), else wait; each kept only where the step then stands
        less over the mean than before it and holds no fewer tokens (a dear piece in the place of cheap ones that
        wait lifts the mean: the step would do the same work in fewer tokens, its linear layers running more
        pad). Whether any was."""
        pending, self._waiting, waiting, tried, missed, placed = self._waiting, [], [], 0, 0, False
        whole = None  # (the whole pieces' slots, computed again once a fill is kept)
        for key, s in pending:
            if s <= self._bins.local or tried == FILL_TRIES or missed == FILL_MISSES:
                waiting.append((key, s))
                continue
            tried += 1
            whole = self._whole_slots() if whole is None else whole
            found = fill_place(self._bins, s, whole)  # (a look first: the trial copies the step)
            if found is not None and self._kept_if_lower(functools.partial(self._fill_one, key, s, found), False):
                whole, placed, missed = None, True, 0
            else:
                waiting.append((key, s))
                missed += 1
        self._waiting = longest_first(waiting + self._waiting)
        return placed

    def _trade(self) -> None:
        """Spread pieces trade windows and a top-up fills what that freed; again, up to :data:`SWAP_PASSES` times
        in all, after a settle, where the step stays over the mean and each pass ends it less over the mean (a
        pass that does not is undone)."""
        for again in range(SWAP_PASSES):
            if not self._bins.over(SPREAD_SWAP_OVER):  # (a balanced step pays nothing)
                break
            if not again:
                self._swap()
            elif not self._kept_if_lower(self._settle_and_swap):
                break
        self._refill()
        self._spread_out()
        self._flip()
        self._densify()

    def _swap(self) -> None:
        SpreadSwap(self._bins, self._step).run()
        self._top_up()

    def _settle_and_swap(self) -> None:
        self._settle()
        self._top_up()
        self._swap()

    def _refill(self) -> None:
        """While the step stands over the mean (:data:`SPREAD_SWAP_OVER`), at most :data:`REFILL_ROUNDS` times: of
        the spread pieces inside a node the busiest rank holds part of, longest first, the first that, taken back
        and placed inside a node (its keys cross no node: placed again across nodes, a piece lifted the step's
        busiest inter-node receiver past Megatron's, the exponential corpus at 32 x 4K, seed 4, 1.03 x) where
        :func:`fill_place` chooses (clearing whole pieces from the room it needs, as the fill does:
        a move, :meth:`SpreadSwap._move`, finds no room where whole pieces fill every micro-batch of the light
        ranks) under the busiest rank's load, leaves the step less over the mean and its tokens no fewer (its busiest
        load is the step's time: held only to less over the mean, a wider cut's dearer tiles would pass for a gain,
        and the busiest rank could rise)."""
        for _ in range(REFILL_ROUNDS):
            load = self._bins.load
            if not self._bins.over(SPREAD_SWAP_OVER):
                return
            h = self._bins.busiest_rank()
            held = sorted(((s, key, where) for key, s, where in self._step
                           if 1 < abs(where[2]) <= self.node_size and h in owner_ranks(where[1], where[2])),
                          reverse=True)  # fmt: skip
            whole, top = self._whole_slots(), max(load)  # (a spread piece taken back leaves them)
            for s, key, where in held:
                b = self._bins  # (a trial not kept puts back a copy)
                b.take_back_spread(s, where)
                found = fill_place(b, s, whole, top)  # (its busiest load under the busiest rank as it stood with it)
                b.restore(s, where)
                phase = functools.partial(self._refill_one, s, key, where, found)
                if found is not None and self._kept_if_lower(phase, False):  # (a look first: the trial copies)
                    break
            else:
                return

    def _refill_one(self, s: int, key: int, where: Placement, found: tuple[Placement, list[tuple[int, int]]]
                    ) -> None:  # fmt: skip
        """Take spread piece ``key`` of ``s`` tokens back from ``where`` and place it again where
        :func:`fill_place` found (:meth:`_fill_one`)."""
        self._step.remove((key, s, where))
        self._bins.take_back_spread(s, where)
        self._fill_one(key, s, found)

    def _spread_out(self) -> None:
        """While the step stands over the mean (:data:`SPREAD_OUT_OVER`), at most :data:`SPREAD_OUT_ROUNDS` times: a
        piece the busiest rank holds part of, in a micro-batch with a rank left empty, is placed again over more
        ranks than a node and than Megatron's power of two, in THD's chunks, as Megatron's scheduler widens a
        sample into the ranks it left empty (:func:`~cpdata.layout.spread.spread_chunks`), where that leaves its
        busiest rank under the busiest rank, no rank receiving more keys, or more keys from other nodes, than the
        step's busiest receivers or :data:`~cpdata.packing.world_fill.FILL_RECEIVE_CAP` times the mean rank's (the
        fill's cap), and the step less over the mean (:meth:`_kept_if_lower`). A step of
        world-sized pieces whose last holds a short document alone, on its 2 ranks (books at 32 x 4K, seed 3:
        1.0039 x the mean rank, Megatron's busiest 1.0004 x its own, the short document over all 32)."""
        for _ in range(SPREAD_OUT_ROUNDS):
            if not self._bins.over(SPREAD_OUT_OVER):
                return
            found = spread_out_choice(self._bins, self._step, self._crossing, self._bins.busiest_rank())
            if found is None or not self._kept_if_lower(functools.partial(self._place_again, *found)):
                return

    def _flip(self) -> None:
        """The step's busiest receiver of keys, then its busiest receiver of keys from other nodes, lowered by
        mirroring spread pieces it holds part of (the window's roles counted from its other end,
        :func:`owner_ranks`), each time the one that lowers it most, where that fits the ranks' room and lifts no
        rank past the busiest load, the busiest receiver or the busiest inter-node receiver; at most
        :data:`FLIP_ROUNDS` times each. The deal's orientation ties go to the least receiver of each placement as
        it comes; the step's sums can still stack first roles on one rank (a corpus of short chats and ~6K-token
        documents at 16 x 8K, seed 23: 19,649 keys on one rank, the mean rank 14,025, Megatron's busiest 18,426)."""
        if not max(self._bins.recv):  # (no spread piece: alpaca's steps, ~12,000 whole pieces, pay nothing)
            return
        spread = [i for i, (_, _, (_, _, c)) in enumerate(self._step) if abs(c) > 1]
        inter = self._inter_keys()  # (kept as pieces are mirrored)
        for inter_first in (False, True):
            for _ in range(FLIP_ROUNDS if not inter_first or max(inter) else 0):
                found = mirror_choice(self._bins, self._step, self._crossing, inter_first, inter, spread)
                if found is None:
                    break
                i, mirrored = found
                _, s, where = self._step[i]
                inter = self._crossing.moved(inter, s, where, mirrored)
                self._place_again(i, mirrored)

    def _densify(self) -> None:
        """Ranks under the busiest take dearer waiting whole pieces in place of cheaper ones (:class:`Densify`); the
        pieces that clears are offered to a top-up, else wait."""
        cleared = Densify(self._bins, self._step, self._waiting).run()
        if cleared:
            self._waiting = longest_first(self._waiting + self._offer(longest_first(cleared), self._bins.top_up))
