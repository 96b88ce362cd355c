"""The world step: ``G`` world micro-batches dealt together, so that each rank's tiles summed over the step balance.

Dealt one at a time (:mod:`~cpdata.layout.world_plan`), a micro-batch gives every rank ``L`` tokens; the
ranks holding a long document's pieces then stay busier than ``L`` tokens of short documents can make the
others. When ranks meet once a step (gradients reduced once, K/V moved only between the ranks that need it:
docs/benchmarks.md), a step lasts as long as the rank whose tiles summed over its micro-batches are most;
:class:`StepBins` balances that sum:

- pieces go longest first;
- a piece longer than ``L`` spreads over ``c`` consecutive ranks, from its fewest, ``ceil(s / L)``, up to the power
  of two Megatron's scheduler would give it (``2^ceil(log2(ceil(s / L)))``, so its keys stay within Megatron's),
  inside one node when ``c <= node_size``, in TE THD's ``2c`` chunks (rank ``i`` of the ``c`` takes chunks ``i`` and
  ``2c - 1 - i``; inside a node, cut on tile boundaries where that costs its busiest rank fewer tiles:
  :func:`~cpdata.layout.spread.aligned_chunks`), or mirrored (rank ``i`` counted down from the window's last:
  :func:`owner_ranks`). Of every width, micro-batch, window of ranks with room and orientation, it takes the one
  whose busiest rank's step load after it is least (ties: the fewest ranks, the first micro-batch, the lowest rank,
  the orientation whose busiest receiver is least, THD's order) among those within the level and the receive cap
  (:data:`RECEIVE_CAP`: the roles receive unequal keys, the first ``(c - 1) / c`` of the document, the last
  ``(c - 1) / 2c``, so a rank that took first roles would receive most: web 32 x 4K, seed 15, 1.49 x Megatron's
  busiest receiver, 0.85 x under the cap; on its fewest ranks a long piece leaves the ranks beside it, with little
  left to fill, lighter than the rest: :meth:`StepBins._spread`). Past the level or the cap it waits, unless it opens
  the step: then it takes the fewest ranks that keep it within the level, since on its fewest ranks it would leave
  their other micro-batches to pad (long_context 32 x 4K, seed 7: a 89,886-token document on 22 of 32 ranks left the
  step 0.415 full at 1.043 x the mean rank; on 32, 0.985 full at 1.010), and takes Megatron's power of two outright
  when its tiles a rank on its fewest pass what whole pieces can add to a rank in the step's other micro-batches (the
  ranks left out could not catch up); where that power of two is narrower than a node and still past the level, it
  goes wider inside the node, up to twice that power of two, in the receive-capped cut (:mod:`~cpdata.layout.spread`:
  no rank receives more than THD's first role would at Megatron's width; web 16 x 8K, seed 13: a 31,467-token document
  on 4 ranks at 7,718 tiles each left the step at 1.375 x the mean rank; on 7, 1.002 x). A piece that waited and ends
  in a micro-batch left empty (:meth:`StepBins.open_empty`) takes, past the level, its width of least busiest load
  (closing, the packer tries those within 1 % of it to the end of the close and keeps the one whose busiest rank ends
  least over the mean: :mod:`cpdata.packing.world_steps`);
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
  - pieces of at most half a tile (a tile each, whatever their length) go in bundles (:func:`bundle_limits`):
    consecutive ones, up to two tiles' tokens, are dealt as one piece of their tokens and tiles, to one rank
    and micro-batch; a bundle that waits is dealt again piece by piece. On a corpus of ~45-token documents
    (about 2,900 a micro-batch at 16 x 8K) that brought the step's solve under its target, its busiest rank as
    balanced as before (docs/benchmarks.md, "Your own corpus").

So micro-batches are not filled to the token: a rank that holds a long document in one micro-batch holds pad
in another. That pad is free: each rank's pad is the tail of its local row (:func:`owned_runs`), which the
varlen kernel does not run (:mod:`cpdata.device.varlen`). A rank's load is exact: its pieces' varlen tiles (a
spread piece's per its chunks, :func:`~cpdata.layout.spread.chunk_tiles`; a whole piece's, ``alone_tiles``).
Priced at a diagonal tile per 128 pad tokens instead, the deal balanced work the kernel does not do: 4 of the
bench's 80 step rows at seeds 1-8 stood over Megatron's busiest rank, against 1 with pad free (before the
settle's swap of one piece for several). When the step closes, :mod:`cpdata.packing.world_steps` settles the
ranks above the mean on these exact loads. The deal travels with its pack as slot owners (:func:`owned_runs`),
never recomputed from the slot lengths.
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Sequence

import numpy as np

from cpdata.layout.spread import chunk_recv, chunk_tiles, megatron_width, spread_chunks, spread_runs
from cpdata.layout.world_plan import alone_tiles, chunk_need

__all__ = ["FILL_RECEIVE_CAP", "LEVEL", "RECEIVE_CAP", "SLACK", "StepBins", "bundle_limits", "owned_runs",
           "owner_ranks"]

SLACK = 0.01
"""A whole piece waits for the next step rather than lift its rank more than this fraction past
:meth:`StepBins.target` (docs/benchmarks.md measures it)."""

DRIFT = 0.05
"""The projected loads are recomputed when the pieces left to deal add tiles per token this fraction away from
the density they were projected with."""

LEVEL = 0.25
"""The quantile of the ranks' projected loads a whole piece may not lift its rank past (:meth:`StepBins.target`;
docs/benchmarks.md measures 0, 0.25 and 0.5)."""

RECEIVE_CAP = 1.6
"""A spread piece waits rather than lift the step's busiest receiver past the most of: the busiest so far, its own first
role's keys, and this many times the mean rank's received keys after it (:meth:`StepBins.place`; at 2, web 16 x 8K at
seed 18 passes Megatron's busiest receiver, 1.30 x, and 32 x 4K at seed 34, 1.04 x; at 1.75 and 1.6 none of web's and
long_context's seeds 1-36 does. Before ties in load went to the orientation of least busiest receiver
(:meth:`StepBins.choose`), 1.75 let web 16 x 8K at seed 18 pass, 1.195 x. With THD's chunks alone, 1.5 left pieces
waiting that long_context needed: 16 x 8K seed 16 stood at 1.001 x Megatron's busiest rank). A later piece that would
wait for the cap alone is tried again against the mean the spread pieces still to come will make, as far as the room
left holds them (:meth:`StepBins.choose`): held to the keys dealt so far, a stream of 8,192-token documents at 32 x
4K filled one micro-batch, then every next one would lift a rank to 6,144 keys, past 1.6 x the mean so far (5,222),
and the step closed 0.18 full at 1.39 x the mean rank; tried again, it fills, its busiest receiver Megatron's."""

FILL_RECEIVE_CAP = 1.25
"""Closing, a waiting spread piece filling the step (:meth:`StepBins.fill`) lifts no rank's received keys past the
most of: the step's busiest receiver, its own busiest role's keys, and this many times the mean rank's keys after
it. At the deal's :data:`RECEIVE_CAP` (1.6), a step of two 24,000-token documents among 512-token chats at 16 x 8K
stacked the second on the first's ranks: twice Megatron's busiest receiver. Held to the first two alone, a mix of
chats and ~30K-token documents at 32 x 4K left its steps as they were (1.037 x the mean rank at seed 4; filled
under this cap, 1.010 x)."""

Placement = tuple[int, int, int]
"""``(micro-batch, first rank, ranks)``: ranks ``first .. first + ranks - 1`` in TE THD's roles, or, where
``ranks`` is negative, ``first`` down to ``first + ranks + 1`` (the window's roles mirrored)."""


def owner_ranks(first: int, ranks: int) -> range:
    """The ranks of a placement ``(first, ranks)`` (:data:`Placement`), in THD role order: role ``j`` of a
    spread piece (chunks ``j`` and ``2c - 1 - j``) is the ``j``-th."""
    return range(first, first + ranks, 1 if ranks > 0 else -1)


@functools.lru_cache(maxsize=4096)
def _roles(s: int, c: int, local: int, tile: int, node_size: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:  # fmt: skip
    """int64 ``[c]`` each (read-only: one cached copy serves every call): ``(tokens, tiles, keys received)`` of
    each role of a document of ``s`` tokens spread over ``c`` ranks of ``local`` tokens, ``node_size`` a node
    (:func:`~cpdata.layout.spread.spread_chunks`); None where that width has no cut."""
    chunk = spread_chunks(s, c, local, node_size)
    if chunk is None:
        return None
    roles = tuple(np.array(v, dtype=np.int64) for v in (chunk_need(chunk), chunk_tiles(chunk, tile), chunk_recv(chunk)))
    for role in roles:
        role.flags.writeable = False
    return roles


class StepBins:
    """The open step: ``packs`` world micro-batches of ``world`` ranks (``node_size`` a node) of ``local`` tokens.

    A rank's ``load`` is its step cost: its pieces' varlen tiles (its trailing pad costs nothing). With
    ``density`` (tiles a token adds, as the pieces to come are expected to),
    a rank's *projected* load is its load plus its free tokens times the density: where it ends if the rest
    of its room fills like the average. :meth:`place` deals one piece (the module docstring's rules) so that
    the projected loads stay equal. Deterministic: the same pieces in the same order, after the same
    :meth:`set_density`, give the same deal; the ranks' orders are kept sorted as pieces land, so a piece costs
    no pass over the world.
    """

    __slots__ = ("packs", "world", "local", "node_size", "tile", "slack", "room", "free", "best_room", "load", "placed",
                 "density", "recv", "_capacity", "_by_load", "_projected", "_total", "_coming",
                 "_spreading")  # fmt: skip

    def __init__(self, packs: int, world: int, local: int, node_size: int, tile: int = 128,
                 slack: float = SLACK) -> None:  # fmt: skip
        self.packs, self.world, self.local, self.node_size, self.tile = packs, world, local, node_size, tile
        self.slack = slack
        self.room = [[local] * packs for _ in range(world)]  # [rank][micro-batch]
        self.free = [local * packs] * world  # per rank, over the micro-batches
        self.best_room = [local] * world  # per rank: the most room of one micro-batch
        self.load = [0.0] * world
        self.recv = [0] * world  # keys each rank receives over the step
        self.placed = 0  # tokens
        self._capacity = packs * world * local
        self.density = 0.0
        # kept sorted as pieces land (a piece changes one rank's entries): no per-piece pass over the world
        self._by_load = _ranked([0.0] * world)  # loads
        self._projected = _ranked([0.0] * world)  # load + free * density
        self._total = 0.0  # the loads' sum
        self._coming = [0.0, 0, 0.0]  # the whole pieces still expected: tiles, tokens; all's density
        self._spreading = [0, 0]  # the spread pieces still expected: keys received on their fewest ranks, tokens

    def ratio(self) -> float:
        """The busiest rank's load over the mean rank's (inf where nothing is loaded)."""
        total = sum(self.load)
        return max(self.load) * self.world / total if total > 0 else float("inf")

    def over(self, fraction: float) -> bool:
        """Whether the busiest rank's load stands more than ``fraction`` above the mean rank's."""
        return max(self.load) > (1 + fraction) * sum(self.load) / self.world

    def busiest_rank(self) -> int:
        """The rank of most load (ties: the lowest)."""
        return self.load.index(max(self.load))

    @property
    def free_tokens(self) -> int:
        """Tokens of room left in the step."""
        return self._capacity - self.placed

    def set_density(self, pieces: Sequence[int]) -> None:
        """Expect the pieces to come to add tiles per token as ``pieces`` (lengths, in the order :meth:`place`
        will see them) do: as :meth:`place` sees each, the ones left of them, and the room they leave as all of
        them (the stream goes on)."""
        lengths = np.asarray(pieces, dtype=np.int64)
        spread = [0, 0, 0]  # the spread pieces' keys and tiles on their fewest ranks, and tokens
        for s in lengths[lengths > self.local].tolist():
            for i, value in enumerate(self._fewest(s)):
                spread[i] += value
        self._spreading = [spread[0], spread[2]]
        whole = lengths[lengths <= self.local]
        added, tokens = int(alone_tiles(whole, self.tile).sum()), int(whole.sum())  # (each, at once)
        if not tokens and len(pieces):  # only pieces longer than a rank to come: they set the level
            self._coming = [0.0, 0, spread[1] / sum(pieces)]
        else:
            self._coming = [added, tokens, added / tokens if tokens else self.density]
        self._reproject()

    def _fewest(self, s: int) -> tuple[int, int, int]:
        """``(keys, tiles, tokens)``: the keys a spread piece of ``s`` tokens makes its ranks receive and the tiles
        it costs on its fewest ranks, and its tokens; zeros where it cannot spread over this world."""
        fewest = -(-s // self.local)
        cut = _roles(s, fewest, self.local, self.tile, self.node_size) if fewest <= self.world else None
        return (0, 0, 0) if cut is None else (int(cut[2].sum()), int(cut[1].sum()), s)

    def _reproject(self) -> None:
        added, tokens, mean = self._coming
        beyond = max(self.free_tokens - tokens, 0)
        self.density = (added + mean * beyond) / (tokens + beyond) if tokens + beyond > 0 else mean
        self._projected = _ranked([self._project(r) for r in range(self.world)])

    def _project(self, r: int) -> float:
        return self.load[r] + self.free[r] * self.density

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
            _move(by_load, was, now, best)
            _move(projected, before, now + free[best] * density, best)
            out += [(k, best, 1)] * count
            i += count
        return out

    def _best_fit(self, r: int, s: int) -> int:
        """The micro-batch of rank ``r`` with the least room that holds ``s`` tokens (ties: the first)."""
        best, least = -1, self.local + 1
        for k, left in enumerate(self.room[r]):
            if s <= left < least:
                best, least = k, left
        return best

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
        arrays = self.snapshot()
        choices = sorted((best for w in range(c, min(self.world, megatron_width(s, self.local)) + 1)
                          if (best := self.choose(s, w, np.inf, k, arrays)) is not None), key=_busiest)  # fmt: skip
        return [best for best in choices if best[0] <= choices[0][0] * (1 + within)]

    def fill(self, s: int, whole: tuple[np.ndarray, np.ndarray] | None = None, below: float | None = None
             ) -> tuple[Placement, list[tuple[int, int]]] | None:  # fmt: skip
        """Where a spread piece of ``s`` tokens goes, past the level, to fill the step: ``(placement, cleared)``,
        ``cleared`` the ``(rank, micro-batch)`` slots whose whole pieces must leave first to make its room; None
        where no place leaves the step's busiest rank less over the mean rank than it stands now (or, where
        ``below`` is given, no place inside one node keeps its busiest load under ``below``: a piece taken back to
        be placed again, whose keys must not cross nodes where they did not). The step is not changed: the caller
        clears those slots, places the piece (:meth:`restore`) and deals the pieces it cleared again
        (:mod:`cpdata.packing.world_steps`, which keeps the result only where the step ends less over the mean
        holding no fewer tokens).

        The places: its widths from its fewest ranks up to Megatron's power of two, past it inside a node as an
        opening piece may go (:meth:`_spread`); each window, micro-batch and orientation within
        :data:`FILL_RECEIVE_CAP`, each role taking the room it has or, where that is short, the room of its slot
        cleared of its whole pieces (``whole``: float64 ``[world, packs]``, their tokens and tiles; None: no slot
        is cleared), that leave the busiest rank less over the mean (its busiest load or the step's, whichever is
        more, over the mean with its tiles in and the cleared ones out). Of those, the least busiest load, then the
        fewest tiles added (its own less the cleared ones); ties as :meth:`choose`'s (the first width,
        micro-batch, rank, the orientation of least busiest receiver, THD's). Least over the mean instead, a wider
        cut's dearer tiles would win where the busiest load is the same: the rows met and the ratios were the same
        over 400 step rows, the work more (docs/benchmarks.md)."""
        top, total = self._by_load[-1][0], self._total
        room, load, recv = self.snapshot()
        tokens, tiles = whole if whole is not None else (np.zeros(room.shape), np.zeros(room.shape))
        fewest = -(-s // self.local)
        if total <= 0 or fewest > self.world or s > self.free_tokens + tokens.sum():
            return None
        most = min(self.world, megatron_width(s, self.local))
        widest = most if most >= self.node_size else min(self.node_size, self.world, 2 * most)
        widest = widest if below is None else min(widest, self.node_size)  # (placed again: inside a node)
        best: tuple[tuple[float, float], Placement, list[tuple[int, int]]] | None = None
        for c in range(fewest, widest + 1):
            cut = _roles(s, c, self.local, self.tile, self.node_size)
            if cut is None:
                continue
            need, added, keys = cut
            mean = (int(recv.sum()) + int(keys.sum())) / self.world
            cap = max(int(recv.max()), int(keys.max()), FILL_RECEIVE_CAP * mean)
            starts, at, roles = _window_index(self.world, self.node_size, c)
            held = room[at][None]  # [1, windows, c, packs]
            wants = need[roles][:, None, :, None]  # [2, 1, c, 1]
            clear = (held < wants) & (held + tokens[at][None] >= wants)  # [2, windows, c, packs]
            receiver = (recv[at][None] + keys[roles][:, None]).max(2)  # [2, windows]
            fits = ((held >= wants) | clear).all(2) & (receiver <= cap)[..., None]
            after = load[at][None, :, :, None] + added[roles][:, None, :, None] - np.where(clear, tiles[at][None], 0)
            score = np.maximum(after.max(2), top)  # [2, windows, packs]
            net = int(added.sum()) - np.where(clear, tiles[at][None], 0).sum(2)
            over = score / np.maximum(total + net, 1e-9)  # (cleared tiles past the rest: no division by zero)
            o, a, k = np.nonzero(fits & (over * total < top if below is None else score < below))
            if not o.size:
                continue
            i = int(np.lexsort((o, receiver[o, a], a, k, net[o, a, k], score[o, a, k]))[0])
            o, a, k = int(o[i]), int(a[i]), int(k[i])
            rank = (float(score[o, a, k]), float(net[o, a, k]))
            if best is None or rank < best[0]:
                first = int(starts[a])
                where = (k, first + c - 1, -c) if o else (k, first, c)
                slots = [(int(r), k) for r, cut_here in zip(at[a], clear[o, a, :, k], strict=True) if cut_here]
                best = (rank, where, slots)
        if best is None:
            return None
        return best[1], best[2]

    def first_empty(self) -> int | None:
        """The first micro-batch no rank holds anything of; None where none."""
        return next((k for k in range(self.packs) if all(room[k] == self.local for room in self.room)), None)

    def copy(self) -> StepBins:
        """An independent copy of the step (a trial deal changes it, not this one)."""
        other = object.__new__(StepBins)
        for name in self.__slots__:
            value = getattr(self, name)
            if name == "room":
                value = [list(room) for room in value]
            elif isinstance(value, list):
                value = list(value)
            setattr(other, name, value)
        return other

    def restore(self, s: int, where: Placement) -> None:
        """Put back a piece :meth:`place` placed at ``where`` (a saved step's)."""
        k, first, c = where
        if c == 1:
            self._take(first, k, s, alone_tiles(s, self.tile))
        else:
            self._take_spread(s, k, first, c)

    def remove(self, s: int, where: Placement) -> None:
        """Take back a piece of ``s`` tokens placed at ``where``, whole (:meth:`take_back`) or spread
        (:meth:`take_back_spread`); :meth:`restore` puts it back."""
        if where[2] == 1:
            self.take_back(s, where)
        else:
            self.take_back_spread(s, where)

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

    def _lightest(self, s: int, most: float, other_than: int) -> int:
        """The least loaded rank but ``other_than`` with room for ``s`` tokens and a load of at most ``most``."""
        best_room = self.best_room
        for value, r in self._by_load:
            if value > most:
                return -1
            if r != other_than and best_room[r] >= s:
                return r
        return -1

    def take_back(self, s: int, where: Placement) -> None:
        """Remove a whole piece of ``s`` tokens placed at ``where`` (it leaves the step)."""
        k, r, c = where
        if c != 1 or not 0 <= r < self.world or not 0 <= k < self.packs or self.room[r][k] + s > self.local:
            raise ValueError(f"no whole piece of {s} tokens can leave {where} of this step")
        self._take(r, k, -s, -alone_tiles(s, self.tile))

    def _take(self, r: int, k: int, s: int, added: float) -> None:
        self._check_room(r, k, s)
        self._put(r, k, s, added)

    def _check_room(self, r: int, k: int, s: int) -> None:
        """``ValueError`` unless rank ``r`` of micro-batch ``k`` is in the step and has room for ``s`` tokens."""
        if not 0 <= r < self.world or not 0 <= k < self.packs or self.room[r][k] < s:
            raise ValueError(f"a piece of {s} tokens does not fit rank {r} of micro-batch {k} of this step "
                             f"({self.packs} x {self.world} ranks of {self.local} tokens)")  # fmt: skip

    def _put(self, r: int, k: int, s: int, added: float) -> None:
        """:meth:`_take` where the caller found the room (the per-document path: no check)."""
        load, free, room, density = self.load, self.free, self.room[r], self.density
        was, projected = load[r], load[r] + free[r] * density
        left = room[k]
        room[k] = left - s
        free[r] -= s
        if s < 0 or left == self.best_room[r]:  # (only then can the rank's most room change)
            self.best_room[r] = max(room)
        load[r] = now = was + added
        self._total += added
        self.placed += s
        _move(self._by_load, was, now, r)
        _move(self._projected, projected, now + free[r] * density, r)

    def roles(self, s: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 ``[c]`` each (read-only): the tokens, tiles and keys received of each role of a piece of ``s``
        tokens spread over ``c`` ranks of this step (:func:`~cpdata.layout.spread.spread_chunks`).
        ``ValueError`` where that width has no cut."""
        cut = _roles(s, c, self.local, self.tile, self.node_size)
        if cut is None:
            raise ValueError(f"a piece of {s} tokens has no cut over {c} ranks of {self.local} tokens")
        return cut

    def cut(self, s: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """:meth:`roles` of a piece of ``s`` tokens on ``c`` ranks, or None where that width has no cut."""
        return _roles(s, c, self.local, self.tile, self.node_size)

    def take_back_spread(self, s: int, where: Placement) -> None:
        """Remove a piece of ``s`` tokens spread at ``where`` (it leaves the step; :meth:`restore` puts it back).
        ``ValueError``, the step unchanged, where no such piece is there."""
        k, first, c = where
        if abs(c) < 2:
            raise ValueError(f"no piece of {s} tokens spread over {c} ranks can leave {where} of this step")
        ranks, roles = owner_ranks(first, c), [role.tolist() for role in self.roles(s, abs(c))]
        for r, need in zip(ranks, roles[0], strict=True):
            if not 0 <= k < self.packs or not 0 <= r < self.world or self.room[r][k] + need > self.local:
                raise ValueError(f"no piece of {s} tokens spread at {where} holds {need} tokens of rank {r}")
        for r, need, added, keys in zip(ranks, *roles, strict=True):
            self._put(r, k, -need, -added)
            self.recv[r] -= keys

    def _take_spread(self, s: int, k: int, first: int, c: int) -> None:
        """Spread ``s`` tokens at ``(k, first, c)``; ``ValueError``, the step unchanged, where a role does not fit."""
        ranks, roles = owner_ranks(first, c), [role.tolist() for role in self.roles(s, abs(c))]
        for r, need in zip(ranks, roles[0], strict=True):
            self._check_room(r, k, need)
        for r, need, added, keys in zip(ranks, *roles, strict=True):
            self._put(r, k, need, added)
            self.recv[r] += keys

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ranks' room (int64 ``[world, packs]``), loads (float64 ``[world]``) and received keys (int64
        ``[world]``) as arrays."""
        return np.array(self.room, dtype=np.int64), np.array(self.load), np.array(self.recv, dtype=np.int64)

    def _spread(self, s: int) -> Placement | None:
        """A piece longer than a rank's tokens: of its widths (the module docstring), micro-batches, windows of
        ranks with room and orientations, the placement whose busiest load after it is least within the receive
        cap (:meth:`choose`) and the level; None (it waits) past the level or the cap. The piece that opens a
        step cannot wait: it takes the fewest ranks, up to the power of two Megatron's scheduler would give it,
        that keep it within the level, else the placement of least busiest load over those widths; it takes that
        power of two outright when its tiles a rank on its fewest would pass what a rank can add in the step's
        other micro-batches, one whole-micro-batch document each (``alone_tiles(local)``): the ranks left out
        could not catch up (long_context 32 x 4K, seed 9: a 115,714-token document on 31 of 32 ranks left the
        32nd at 0.32 x the mean rank, the step 1.036 x; on 32, 1.012 x). Where that power of two is narrower
        than a node, the opening piece's widths go on up to the node's ranks or twice the power of two,
        whichever is fewer, in the receive-capped cut (:func:`~cpdata.layout.spread.spread_chunks`; its first
        role must hold ``1 / w`` of the document at Megatron's width ``w``, whose work alone passes the mean
        role's past about ``w^2`` ranks, and the widths cost a cut each on a large node); a width with no such
        cut is skipped. A later piece takes, of its widths from its fewest ranks up to that power of two, the
        placement of least busiest load within the level (ties: the fewest ranks; where none is within the receive
        cap, within the cap counting the spread pieces to come: :data:`RECEIVE_CAP`), else it waits: on its fewest
        ranks a long piece leaves ranks that have little left to fill it with lighter than the rest (books at 16
        x 8K, seed 1, the rest of the deal as it is: documents of 18,000-36,000 tokens on 3 and 5 ranks left the
        busiest rank at 1.041 x the mean, 1.022 x Megatron's; at their widths up to Megatron's, 1.002 x and
        0.988 x; docs/benchmarks.md, "Your own corpus")."""
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
        behind = most > fewest and (int(_roles(s, fewest, self.local, self.tile, self.node_size)[1].max())
                                    > (self.packs - 1) * densest)  # fmt: skip
        arrays = self.snapshot()
        if opening and behind:
            best = self.choose(s, most, arrays=arrays)  # (the ranks left out could not catch up: Megatron's width)
            if best is not None:
                return self._take_choice(s, best)
        level = self.target() * (1 + self.slack)
        choices = [best for c in range(fewest, widest + 1) if (best := self.choose(s, c, arrays=arrays)) is not None]
        within = [best for best in choices if best[0] <= level]
        if not within and not opening and self._spreading[1]:  # (nothing to come: the same cap)
            choices = [best for c in range(fewest, widest + 1)
                       if (best := self.choose(s, c, arrays=arrays, coming=True)) is not None]  # fmt: skip
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

    def choose(self, s: int, c: int, cap: float | None = None, pack: int | None = None,
               arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, coming: bool = False
               ) -> tuple[float, int, int, int] | None:  # fmt: skip
        """``(busiest load after, micro-batch, first rank, signed ranks)``: of the placements of a piece of ``s``
        tokens on ``c`` ranks (:func:`_windows`, either orientation; micro-batch ``pack`` alone where given) with
        room, whose busiest receiver stays within ``cap`` (None: the receive cap, :data:`RECEIVE_CAP`, its mean
        counting, with ``coming``, the keys the spread pieces still to come (:meth:`set_density`) would add on their
        fewest ranks, as many of them as the room left holds), the one of
        least busiest load (ties: the first micro-batch, the lowest rank, the orientation whose busiest receiver
        after it is least, THD's); None where none. (Equal pieces tie on every orientation: THD's each time gave
        a rank the first role in every micro-batch, 8,192-token documents at 32 x 4K 32,768 keys, Megatron's
        busiest receiver; alternating, 24,576.)
        The caller holds that load to its level: the least placement past it means none within it.

        The THD roles receive unequal keys (the first rank ``(c - 1) / c`` of the document, the last
        ``(c - 1) / 2c``: :func:`~cpdata.layout.spread.thd_recv`) for near-equal tiles, so under the cap a window
        or its mirror keeps a rank that received much from receiving most again (web 32 x 4K, seed 15: 1.49 ->
        0.85 x Megatron's busiest receiver). ``arrays``: :meth:`snapshot` of the state as it is, where the caller
        tries several widths of one piece."""
        cut = _roles(s, c, self.local, self.tile, self.node_size)
        if cut is None:
            return None
        need, added, keys = cut
        room, load, recv = self.snapshot() if arrays is None else arrays
        if cap is None:
            to_come = 0.0
            if coming and self._spreading[1]:  # the keys of the spread pieces to come, in the room left
                to_come = self._spreading[0] * min(1.0, max(self.free_tokens - s, 0) / self._spreading[1])
            cap = max(int(recv.max()), int(keys.max()),
                      RECEIVE_CAP * (int(recv.sum()) + int(keys.sum()) + to_come) / self.world)  # fmt: skip
        starts, at, roles = _window_index(self.world, self.node_size, c)
        held = room[at] if pack is None else room[at][:, :, pack:pack + 1]  # [starts, c, packs]
        score = (load[at][None] + added[roles][:, None]).max(2)  # [2, starts]
        receiver = (recv[at][None] + keys[roles][:, None]).max(2)  # [2, starts]
        fits = (held[None] >= need[roles][:, None, :, None]).all(2)  # [2, starts, packs]
        o, a, k = np.nonzero(fits & (receiver <= cap)[:, :, None])
        if not o.size:
            return None
        i = np.lexsort((o, receiver[o, a], a, k, score[o, a]))[0]
        o, w, k = int(o[i]), int(a[i]), int(k[i]) if pack is None else pack
        first = int(starts[w])
        return (float(score[o, w]), k, first + c - 1, -c) if o else (float(score[o, w]), k, first, c)


def bundle_limits(tile: int, local: int) -> tuple[int, int]:
    """``(small, bundled)``: :meth:`StepBins.deal` deals consecutive pieces of at most ``small`` tokens (half a
    tile: a tile each, whatever their length) as one, up to ``bundled`` tokens (two tiles, at most a rank's)."""
    return tile // 2, min(2 * tile, local)


def _windows(world: int, node_size: int, c: int) -> list[int]:
    """First ranks of the windows of ``c`` consecutive ranks a spread piece may take: inside one node when it fits
    one, else from a node's first rank (whole nodes first)."""
    if c > node_size:
        return list(range(0, world - c + 1, node_size))
    return [a for a in range(world - c + 1) if a // node_size == (a + c - 1) // node_size]


@functools.lru_cache(maxsize=1024)
def _window_index(world: int, node_size: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int64 ``[W]`` the windows' first ranks (:func:`_windows`), ``[W, c]`` their ranks, and ``[2, c]`` the role
    at each position of a window, in THD's orientation and mirrored."""
    starts = np.array(_windows(world, node_size, c), dtype=np.int64).reshape(-1)
    roles = np.stack([np.arange(c), np.arange(c)[::-1]])
    return starts, starts[:, None] + np.arange(c), roles


def _busiest(choice: tuple[float, int, int, int]) -> float:
    """A :meth:`StepBins.choose` placement's busiest load after it (``min`` keeps the first of equals: the
    fewest ranks, as the widths are tried)."""
    return choice[0]


def _ranked(values: list[float]) -> list[tuple[float, int]]:
    """The ranks sorted by a value (ties: the lower rank), as ``(value, rank)`` keys: each key is unique, so a
    rank's entry is found by one bisection, however many ranks share its value (:func:`_move` keeps the order)."""
    return sorted(zip(values, range(len(values)), strict=True))


def _move(keys: list[tuple[float, int]], old: float, new: float, r: int) -> None:
    """In sorted ``(value, rank)`` keys, rank ``r``'s value goes from ``old`` to ``new`` (in place where its order
    holds: most pieces move it past no other rank)."""
    key = (new, r)
    i = bisect_left(keys, (old, r))
    if new >= old:  # (it can only move right: its left neighbour stays before it)
        if i + 1 == len(keys) or key < keys[i + 1]:
            keys[i] = key
            return
        del keys[i]
        keys.insert(bisect_left(keys, key, i), key)
    else:  # (it can only move left)
        if i == 0 or keys[i - 1] < key:
            keys[i] = key
            return
        del keys[i]
        keys.insert(bisect_left(keys, key, 0, i), key)


def owned_runs(slot_lens: np.ndarray, owners: np.ndarray, pack_len: int, world: int, node_size: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The runs of a pack a world step dealt (:class:`StepBins`, :attr:`PackPlan.owners`): ``(starts, lengths,
    owners)`` int64 ``[R]`` sorted by global start, tiling ``[0, pack_len)``, every rank ``pack_len / world``
    positions (its pad last).

    ``slot_lens`` int64 ``[D]``; ``owners`` int64 ``[D, 2]``: each slot's first rank and ranks (1: whole on the
    first; ``c > 1``: the ``2c`` chunks of :func:`~cpdata.layout.spread.spread_chunks` over ``c`` consecutive
    ranks up from the first, rank ``first + j`` taking chunks ``j`` and ``2c - 1 - j``: TE THD's up to Megatron's
    width, on tile boundaries inside one node of ``node_size`` ranks, the receive-capped cut wider; ``-c``: the
    same roles down from it, :func:`owner_ranks`). ``node_size`` is the deal's: the cut depends on it.
    ``ValueError`` when a rank would hold more than its positions, a slot names a rank outside the world, or a
    width has no cut.
    """
    local = pack_len // world
    held = np.zeros(world, dtype=np.int64)
    runs: list[tuple[int, int, int]] = []
    at = 0
    for s, (first, c) in zip(slot_lens.tolist(), owners.tolist(), strict=True):
        ranks = owner_ranks(first, c)
        if not ranks or not (0 <= min(ranks) and max(ranks) < world):
            raise ValueError(f"a slot of {s} tokens names ranks {first}..{first + c - (1 if c > 0 else -1)} "
                             f"(first rank {first}, ranks {c}), outside a world of {world}")  # fmt: skip
        if len(ranks) == 1:
            runs.append((at, s, first))
            held[first] += s
        for offset, n, i in spread_runs(s, len(ranks), local, node_size) if len(ranks) > 1 else ():
            runs.append((at + offset, n, ranks[i]))
            held[ranks[i]] += n
        at += s
    if int(held.max(initial=0)) > local or at > pack_len:
        raise ValueError(f"slot owners give a rank {int(held.max())} tokens (slots {at}) in a pack of {pack_len} "
                         f"tokens over {world} ranks ({local} each); the owners belong to another pack")  # fmt: skip
    for r in range(world):
        n = local - int(held[r])
        if n:
            runs.append((at, n, r))
            at += n
    out = np.array(sorted(runs), dtype=np.int64).reshape(-1, 3)
    return out[:, 0].copy(), out[:, 1].copy(), out[:, 2].copy()
