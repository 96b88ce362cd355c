"""The world step: ``G`` world micro-batches dealt together, so that each rank's tiles summed over the step balance.

Dealt one at a time (:mod:`~cpdata.layout.world_plan`), a micro-batch gives every rank ``L`` tokens; the
ranks holding a long document's pieces then stay busier than ``L`` tokens of short documents can make the
others. When ranks meet once a step (gradients reduced once, K/V moved only between the ranks that need it:
docs/benchmarks.md), a step lasts as long as the rank whose tiles summed over its micro-batches are most;
:class:`StepBins` balances that sum:

- pieces go longest first;
- a piece longer than ``L`` spreads over ``c`` consecutive ranks, from its fewest, ``ceil(s / L)``, up to the power of
  two Megatron's scheduler would give it (``2^ceil(log2(ceil(s / L)))``, so its keys stay within Megatron's), inside
  one node when ``c <= node_size``, in TE THD's ``2c`` chunks (rank ``i`` of the ``c`` takes chunks ``i`` and ``2c - 1
  - i``; inside a node, cut on tile boundaries where that costs its busiest rank fewer tiles:
  :func:`~cpdata.layout.spread.aligned_chunks`), or mirrored (rank ``i`` counted down from the window's last:
  :func:`~cpdata.layout.world_owners.owner_ranks`). Of every width, micro-batch, window of ranks with room and
  orientation, it takes the one whose busiest rank's step load after it is least (ties: the fewest ranks, the first
  micro-batch, the lowest rank, the orientation whose busiest receiver is least, THD's order) among those within the
  level and the receive cap (:data:`~cpdata.layout.step_loads.RECEIVE_CAP`: the roles receive unequal keys, the first
  ``(c - 1) / c`` of the document, the last ``(c - 1) / 2c``, so a rank that took first roles would receive most: web
  32 x 4K, seed 15, 1.49 x Megatron's busiest receiver, 0.85 x under the cap; on its fewest ranks a long piece leaves
  the ranks beside it, with little left to fill, lighter than the rest: :meth:`StepBins._spread`). Past the level or
  the cap it waits, unless it opens the step: then it takes the fewest ranks that keep it within the level, since on
  its fewest ranks it would leave their other micro-batches to pad (long_context 32 x 4K, seed 7: a 89,886-token
  document on 22 of 32 ranks left the step 0.415 full at 1.043 x the mean rank; on 32, 0.985 full at 1.010), and takes
  Megatron's power of two outright when its tiles a rank on its fewest pass what whole pieces can add to a rank in the
  step's other micro-batches (the ranks left out could not catch up); where that power of two is narrower than a node
  and still past the level, it goes wider inside the node, up to twice that power of two, in the receive-capped cut
  (:mod:`~cpdata.layout.spread`: no rank receives more than THD's first role would at Megatron's width; web 16 x 8K,
  seed 13: a 31,467-token document on 4 ranks at 7,718 tiles each left the step at 1.375 x the mean rank; on 7, 1.002
  x). A piece that waited and ends in a micro-batch left empty
  (:meth:`~cpdata.layout.step_moves.StepMoves.open_empty`) takes, past the level, its width of least busiest load
  (closing, the packer tries those within 1 % of it to the end of the close and keeps the one whose busiest rank
  ends least over the mean: :mod:`cpdata.packing.world_steps`);
- a piece of at most ``L`` tokens goes whole into the micro-batch with the least room that fits it (ties: the
  first), on a rank chosen by the tiles it adds (``a``) against the pieces still to come (``d``, tiles per
  token; :meth:`StepBins.set_density`):

  - dearer than them (``a >= s * d``): the least loaded rank with room; it waits for the next step
    (:meth:`StepBins.place` returns None) when that would lift the rank past :meth:`StepBins.target`
    times ``1 + slack``;
  - cheaper: the rank of highest *projected* load (its load plus its free tokens times ``d``) with room whose
    load it keeps under the lower of the mean projected load and the target (times ``1 + slack``), so the
    ranks that took dear pieces fill with cheap ones instead of ending half empty beside ranks full of
    cheap pieces (alpaca 16 x 8K: fill 0.97 -> 1.00); else it waits;
  - pieces of at most a tile (a tile each, whatever their length) go in bundles (:func:`bundle_limits`):
    consecutive ones, up to four tiles' tokens, are dealt as one piece of their tokens and tiles, to one rank
    and micro-batch; a bundle that waits is dealt again piece by piece. On a corpus of ~45-token documents
    (about 2,900 a micro-batch at 16 x 8K) bundles of half-tile pieces up to two tiles brought the step's solve
    under its target, its busiest rank as balanced as before (docs/benchmarks.md, "Your own corpus"); pieces up to
    a tile in bundles of four tiles took about a quarter off alpaca's (half its documents are 65-128 tokens), the
    same rows meeting (docs/benchmarks.md).

So micro-batches are not filled to the token: a rank that holds a long document in one micro-batch holds pad in
another. That pad is free: each rank's pad is the tail of its local row
(:func:`~cpdata.layout.world_owners.owned_runs`), which the varlen kernel does not run (:mod:`cpdata.device.varlen`).
A rank's load is exact: its pieces' varlen tiles (a spread piece's per its chunks,
:func:`~cpdata.layout.spread.chunk_tiles`; a whole piece's, ``alone_tiles``). Priced at a diagonal tile per 128 pad
tokens instead, the deal balanced work the kernel does not do: 4 of the bench's 80 step rows at seeds 1-8 stood over
Megatron's busiest rank, against 1 with pad free (before the settle's swap of one piece for several). When the step
closes, :mod:`cpdata.packing.world_close` settles the ranks above the mean on these exact loads. The deal travels with
its pack as slot owners (:func:`~cpdata.layout.world_owners.owned_runs`), never recomputed from the slot lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

from cpdata.layout.ranked import move_key
from cpdata.layout.spread import megatron_width
from cpdata.layout.step_loads import StepLoads
from cpdata.layout.world_owners import Placement
from cpdata.layout.world_plan import alone_tiles

__all__ = ["DRIFT", "LEVEL", "SLACK", "StepBins", "bundle_limits"]

SLACK = 0.01
"""A whole piece waits for the next step rather than lift its rank more than this fraction past
:meth:`StepBins.target` (docs/benchmarks.md measures it)."""

DRIFT = 0.05
"""The projected loads are recomputed when the pieces left to deal add tiles per token this fraction away from
the density they were projected with."""

LEVEL = 0.25
"""The quantile of the ranks' projected loads a whole piece may not lift its rank past (:meth:`StepBins.target`;
docs/benchmarks.md measures 0, 0.25 and 0.5)."""


class StepBins(StepLoads):
    """The deal of an open step (:class:`~cpdata.layout.step_loads.StepLoads`: its books): :meth:`place` deals one
    piece (the module docstring's rules) so that the projected loads stay equal. Deterministic: the same pieces in
    the same order, after the same :meth:`set_density`, give the same deal; the ranks' orders are kept sorted as
    pieces land, so a piece costs no pass over the world. ``slack``: a whole piece waits rather than lift its rank
    past :meth:`target` times ``1 + slack``.
    """

    __slots__ = ("slack",)

    def __init__(self, packs: int, world: int, local: int, node_size: int, tile: int = 128,
                 slack: float = SLACK) -> None:  # fmt: skip
        super().__init__(packs, world, local, node_size, tile)
        self.slack = slack

    def target(self) -> float:
        """The level a whole piece may not lift its rank past (times ``1 + slack``): the :data:`LEVEL`
        quantile of the ranks' projected loads (the least would let one rank filled early with cheap pieces
        hold every other rank back; the mean, let the ranks of the long documents take their full room)."""
        return self._projected[int(LEVEL * (self.world - 1))][0]

    def place(self, s: int) -> Placement | None:
        """Deal a piece of ``s`` tokens: its ``(micro-batch, first rank, ranks)``, or None (it waits; no rank
        changes). A whole piece also narrows the expectation of the pieces to come (:meth:`set_density`).
        (:meth:`deal` of one piece.)"""
        return self.deal([s])[0]

    def deal(self, pieces: Sequence[int]) -> list[Placement | None]:
        """:meth:`place` each of ``pieces`` in order (the module docstring's rules), the small ones in bundles
        (:func:`bundle_limits`: :meth:`place` of one piece bundles nothing). A whole piece or bundle is the
        per-document path (about 2,900 documents a micro-batch of 45-token documents), run with its lookups
        hoisted out of the loop and :meth:`_best_fit` and :meth:`_put` inline: calling them costs this loop about
        a sixth more (docs/benchmarks.md, "Costs of single steps"). Tests hold it to a step-by-step reference on
        random streams. A spread piece goes to :meth:`_spread`."""
        out: list[Placement | None] = []
        local, tile, slack, world, capacity = self.local, self.tile, 1 + self.slack, self.world, self._capacity
        load, free, rooms, best_room, coming = self.load, self.free, self.room, self.best_room, self._coming
        by_load, quantile, drift = self._by_load, int(LEVEL * (world - 1)), DRIFT
        small, bundled = bundle_limits(tile, local)
        i, n, alone = 0, len(pieces), 0  # pieces before ``alone`` are dealt one by one (their bundle waited)
        while i < n:
            s = pieces[i]
            if s > local:
                out.append(self._spread(s))
                i += 1
                continue
            count = 1
            if 0 < s <= small and i >= alone:  # a bundle: the consecutive small pieces up to ``bundled`` tokens
                while i + count < n and 0 < (t := pieces[i + count]) <= small and s + t <= bundled:
                    s += t
                    count += 1
                added = count  # (a tile each)
            else:
                blocks = -(-s // tile)
                added = blocks * (blocks + 1) // 2  # (alone_tiles)
            # a whole piece of the expected ones: the density of the pieces to come, reprojected where it drifted
            coming[0] -= added
            coming[1] -= s
            left = coming[1]
            placed = self.placed
            beyond = capacity - placed - left
            if beyond < 0:
                beyond = 0
            density = self.density
            expected = (coming[0] + coming[2] * beyond) / (left + beyond) if left + beyond > 0 else density
            if abs(expected - density) > drift * density:
                self._reproject()
                density = self.density
            projected = self._projected
            best = -1
            if added >= s * density:  # dearer than the pieces to come
                for _, r in by_load:
                    if best_room[r] >= s:
                        best = r
                        break
                if best < 0 or (placed and load[best] + added > projected[quantile][0] * slack):
                    best = -1
            else:
                level = (self._total + (capacity - placed) * density) / world
                target = projected[quantile][0]
                level = (level if level < target else target) * slack
                for _, r in reversed(projected):
                    if best_room[r] >= s and load[r] + added <= level:
                        best = r
                        break
            if best < 0:
                if count > 1:  # the bundle's pieces go one by one
                    coming[0] += added
                    coming[1] += s
                    alone = i + count
                else:
                    out.append(None)
                    i += 1
                continue
            # (_best_fit and _put)
            room = rooms[best]
            k, least = -1, local + 1
            for j, room_left in enumerate(room):
                if s <= room_left < least:
                    k, least = j, room_left
            was = load[best]
            before = was + free[best] * density
            room[k] = least - s
            free[best] -= s
            if least == best_room[best]:
                best_room[best] = max(room)
            load[best] = now = was + added
            self._total += added
            self.placed = placed + s
            move_key(by_load, was, now, best)
            move_key(projected, before, now + free[best] * density, best)
            out += [(k, best, 1)] * count
            i += count
        return out

    def _spread(self, s: int) -> Placement | None:
        """A piece longer than a rank's tokens: of its widths (the module docstring), micro-batches, windows of ranks
        with room and orientations, the placement whose busiest load after it is least within the receive cap
        (:meth:`choose`) and the level; None (it waits) past the level or the cap. The piece that opens a step cannot
        wait: it takes the fewest ranks, up to the power of two Megatron's scheduler would give it, that keep it
        within the level, else the placement of least busiest load over those widths; it takes that power of two
        outright when its tiles a rank on its fewest would pass what a rank can add in the step's other micro-batches,
        one whole-micro-batch document each (``alone_tiles(local)``): the ranks left out could not catch up
        (long_context 32 x 4K, seed 9: a 115,714-token document on 31 of 32 ranks left the 32nd at 0.32 x the mean
        rank, the step 1.036 x; on 32, 1.012 x). Where that power of two is narrower than a node, the opening piece's
        widths go on up to the node's ranks or twice the power of two, whichever is fewer, in the receive-capped cut
        (:func:`~cpdata.layout.spread.spread_chunks`; its first role must hold ``1 / w`` of the document at Megatron's
        width ``w``, whose work alone passes the mean role's past about ``w^2`` ranks, and the widths cost a cut each
        on a large node); a width with no such cut is skipped. A later piece takes, of its widths from its fewest
        ranks up to that power of two, the placement of least busiest load within the level (ties: the fewest ranks;
        where none is within the receive cap, within the cap counting the spread pieces to come:
        :data:`~cpdata.layout.step_loads.RECEIVE_CAP`), else it waits: on its fewest ranks a long piece leaves ranks
        that have little left to fill it with lighter than the rest (books at 16 x 8K, seed 1, the rest of the deal as
        it is: documents of 18,000-36,000 tokens on 3 and 5 ranks left the busiest rank at 1.041 x the mean, 1.022 x
        Megatron's; at their widths up to Megatron's, 1.002 x and 0.988 x; docs/benchmarks.md, "Your own corpus")."""
        least, _, tokens = self._fewest(s)  # (this piece is no longer to come)
        self._spreading = [max(self._spreading[0] - least, 0), max(self._spreading[1] - tokens, 0)]
        fewest = -(-s // self.local)
        if fewest > self.world or s > self.free_tokens:
            return None
        opening = not self.placed
        most = min(self.world, megatron_width(s, self.local))
        # past Megatron's width, inside a node, the receive-capped cut (cpdata.layout.spread), up to twice the width
        widest = most if not opening or most >= self.node_size else min(self.node_size, self.world, 2 * most)
        densest = alone_tiles(self.local, self.tile)  # the most tiles a whole piece adds to a micro-batch
        behind = most > fewest and int(self.cut(s, fewest)[1].max()) > (self.packs - 1) * densest
        if opening and behind:
            best = self.choose(s, most)  # (the ranks left out could not catch up: Megatron's width)
            if best is not None:
                return self._take_choice(s, best)
        level = self.target() * (1 + self.slack)
        widths = range(fewest, widest + 1)
        if not opening:  # (only a placement within the level will do)
            widths = self.widths_under(s, widths, level)
            if not widths:
                return None
        arrays = self.snapshot()
        choices = [best for best in self.choose_widths(s, widths, arrays=arrays) if best is not None]
        within = [best for best in choices if best[0] <= level]
        if not within and not opening and self._spreading[1]:  # (nothing to come: the same cap)
            choices = [best for best in self.choose_widths(s, widths, arrays=arrays, coming=True) if best is not None]
            within = [best for best in choices if best[0] <= level]
        if opening:  # the fewest ranks within the level, else the least busiest load
            return self._take_choice(s, within[0] if within else min(choices, key=_busiest, default=None))
        return self._take_choice(s, min(within, key=_busiest, default=None))

    def _take_choice(self, s: int, choice: tuple[float, int, int, int] | None) -> Placement | None:
        """Spread ``s`` tokens where :meth:`choose` chose (None: nowhere)."""
        if choice is None:
            return None
        _, k, first, c = choice
        self._take_spread(s, k, first, c)
        return k, first, c


def bundle_limits(tile: int, local: int) -> tuple[int, int]:
    """``(small, bundled)``: :meth:`StepBins.deal` deals consecutive pieces of at most ``small`` tokens (a tile: a
    tile each, whatever their length) as one, up to ``bundled`` tokens (four tiles, at most a rank's)."""
    return tile, min(4 * tile, local)


def _busiest(choice: tuple[float, int, int, int]) -> float:
    """A :meth:`StepBins.choose` placement's busiest load after it (``min`` keeps the first of equals: the
    fewest ranks, as the widths are tried)."""
    return choice[0]
