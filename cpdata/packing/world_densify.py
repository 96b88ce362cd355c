"""The last phase of a closing world step: its ranks under the busiest take dearer waiting documents in place of
cheaper ones (:class:`Densify`).

Once the close has lowered the busiest rank as far as it goes, the busiest rank's load is the step's time. A rank
under it whose room is full runs short documents while dearer ones (more tiles a token: longer documents) wait for
a later step. Swapping them costs this step nothing (the rank stays at or under the busiest) and leaves less work
for the steps after it. The shape that needs it: a document on a few ranks that no cut lowers, beside ranks full of
short documents (sft 16 x 8K, seed 3, its second step: a 14,869-token document alone on 2 ranks at 3,509 tiles, the
other ranks full at about 3,240).

Each waiting whole document, longest first, goes where it adds most tiles on the least loaded rank that can take it:
into a micro-batch whose shortest whole documents, cleared, make its room, where the tiles it adds past theirs keep
the rank at or under the busiest, and the tokens cleared past its own cost no more than those tiles. Tokens the step
no longer holds are pad its linear layers run (:class:`~cpdata.layout.world_cost.WorldCost`: a position costs about
a tile, :data:`PAD_TILES`), and the tiles are work taken off a later step at no cost to this one. Holding the
cleared tokens to the document's own, a full rank (room of a few tokens) could take a document only where its
shortest documents summed to its length almost exactly: web 16 x 8K, seed 109, a 40,812-token document on 8 ranks
beside 8 ranks full of short ones, stood at 1.057 x the mean rank (a 5,270-token document found no such micro-batch);
priced, 1.004 x, with 0.2 % of the step's tokens left to the next (docs/benchmarks.md). The cleared documents wait,
or are topped up elsewhere by the packer.

Waiting documents longer than a rank and no wider than a node go first, longest first: each spreads inside one node
(no key crosses nodes) where each of its roles' ranks clears its micro-batch's shortest whole documents for the
role's room, under the same two bounds (at or under the busiest load; the tokens cleared past its own paid for by the
tiles added), and no rank receives more keys than the step's busiest receiver (:meth:`Densify._spread_place`). A
document filling its node's 8 ranks beside ranks full of short documents, with the step's other long documents
waiting, needs them: web 32 x 4K, seed 13, a 31,467-token document at 3,824 tiles a rank, the others at about
2,800 (1.25 x the mean rank; whole documents alone, which are short there, could not lift them); spread in,
1.006 x (docs/benchmarks.md).

Trade-off: a search over every rank and micro-batch per document (one array pass; a spread document, every width,
window and orientation inside a node), at most :data:`DENSIFY_SPREAD_TRIES` spread documents (none after
:data:`DENSIFY_SPREAD_MISSES` misses in a row) and :data:`DENSIFY_TRIES` whole documents a close, and none once the
step stands within :data:`DENSIFY_OVER` of its mean; a document of a length that found no place is not tried again
at that length until one is placed.
"""

from __future__ import annotations

import numpy as np

from cpdata.layout.world_cost import H100_DEFAULTS
from cpdata.layout.world_owners import Placement, window_index, window_owners
from cpdata.layout.world_plan import alone_tiles
from cpdata.layout.world_step import StepBins

__all__ = ["DENSIFY_OVER", "DENSIFY_SPREAD_MISSES", "DENSIFY_SPREAD_TRIES", "DENSIFY_TRIES", "PAD_TILES", "Densify"]

DENSIFY_OVER, DENSIFY_TRIES = 0.005, 128
"""Closing, the step's ranks take dearer waiting documents while it stands more than this fraction over its mean
rank, at most this many waiting documents tried (:class:`Densify`)."""

DENSIFY_SPREAD_TRIES, DENSIFY_SPREAD_MISSES = 8, 2
"""Closing, at most this many waiting pieces longer than a rank are tried, longest first, and none after this many in
a row found no place (:meth:`Densify._spread_place`: a search over every width, window and micro-batch inside a
node)."""

PAD_TILES = H100_DEFAULTS.per_position_seconds / H100_DEFAULTS.per_tile_seconds
"""Tiles a position of pad costs (a position through the linear layers against a live tile, the cost model's H100
defaults: 1.03): a swap's tokens cleared past the document's own, times this, are at most the tiles it adds past
the cleared ones. The defaults' ratio, not a calibration file's: a ``world`` layout string carries only the keys'
prices."""


class Densify:
    """Waiting documents (whole, or spread inside a node) swapped into a closing step in place of cheaper whole
    documents, on ranks under the busiest (the module docstring). ``step`` (``(key, tokens, placement)``) and
    ``waiting`` (``(key, tokens)``) are the packer's lists, changed in place; :meth:`run` returns the documents it
    cleared, which the caller offers to the step again or keeps waiting."""

    def __init__(self, bins: StepBins, step: list[tuple[int, int, Placement]], waiting: list[tuple[int, int]]
                 ) -> None:  # fmt: skip
        self.bins, self.step, self.waiting = bins, step, waiting

    def _books(self) -> None:
        """Each slot's (``rank * packs + micro-batch``) whole pieces, shortest first (ties: by key), and the
        tokens and tiles of its ``m`` shortest (``m = 0 ..``; past its pieces, none), in one pass over the step."""
        bins, slots = self.bins, self.bins.world * self.bins.packs
        whole = np.array([(r * bins.packs + k, s, key) for key, s, (k, r, c) in self.step if c == 1],
                         dtype=np.int64).reshape(-1, 3)  # fmt: skip
        slot, length, key = whole[:, 0], whole[:, 1], whole[:, 2]
        order = np.lexsort((key, length, slot))
        slot, length, key = slot[order], length[order], key[order]
        counts = np.bincount(slot, minlength=slots)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        at = np.arange(len(slot)) - first[slot] + 1  # (column m of the piece that makes m)
        self.tokens = np.full((slots, int(counts.max(initial=0)) + 1), -np.inf)
        self.tiles = np.zeros(self.tokens.shape)
        self.tokens[:, 0] = 0.0
        for target, values in ((self.tokens, length), (self.tiles, alone_tiles(length, bins.tile))):
            total = np.concatenate([[0], np.cumsum(values)])
            target[slot, at] = total[1:] - total[first[slot]]
        bounds = np.concatenate([first, [len(slot)]]).tolist()
        pairs = list(zip(length.tolist(), key.tolist(), strict=True))
        self.held = [pairs[bounds[q]:bounds[q + 1]] for q in range(slots)]
        self.rank_of = np.repeat(np.arange(bins.world), bins.packs)

    def _prefix(self, slot: int) -> None:
        """Slot ``slot``'s row of the tokens and tiles from its pieces (the arrays widen to hold them)."""
        lengths = np.array([s for s, _ in self.held[slot]], dtype=np.int64)
        n = len(lengths)
        if n + 1 > self.tokens.shape[1]:  # (a document placed into room, none cleared)
            more = n + 1 - self.tokens.shape[1]
            self.tokens = np.hstack([self.tokens, np.full((len(self.held), more), -np.inf)])
            self.tiles = np.hstack([self.tiles, np.zeros((len(self.held), more))])
        self.tokens[slot] = -np.inf
        self.tokens[slot, : n + 1] = np.concatenate([[0], np.cumsum(lengths)])
        self.tiles[slot] = 0.0
        self.tiles[slot, : n + 1] = np.concatenate([[0], np.cumsum(alone_tiles(lengths, self.bins.tile))])

    def run(self) -> list[tuple[int, int]]:
        """Swap while the step stands over its mean; the documents cleared, ``(key, tokens)``."""
        bins = self.bins
        local, packs = bins.local, bins.packs
        if not bins.over(DENSIFY_OVER):  # (a balanced step builds no books)
            return []
        widest = local * min(bins.node_size, bins.world)
        candidates = sorted((piece for piece in self.waiting if piece[1] <= widest), key=lambda p: (-p[1], p[0]))
        longer = sum(s > local for _, s in candidates)  # (longest first: these lead; each kind its own tries)
        candidates = candidates[:min(longer, DENSIFY_SPREAD_TRIES)] + candidates[longer:longer + DENSIFY_TRIES]
        if not candidates:
            return []
        self._books()
        room = np.array(bins.room, dtype=np.float64).reshape(-1)  # [world * packs], kept as slots change
        rows = np.arange(len(self.held))
        cleared: list[tuple[int, int]] = []
        placed: set[int] = set()
        failed: set[int] = set()  # lengths that found no place since the last swap
        top = bins.busiest_load
        spread: list[tuple[int, int, Placement]] = []
        misses = 0  # spread documents in a row that found no place
        for key, s in candidates:
            if not bins.over(DENSIFY_OVER):
                break
            if s in failed or (s > local and misses == DENSIFY_SPREAD_MISSES):
                continue
            if s > local:
                found = self._spread_place(s, room, top)
                if found is None:
                    failed.add(s)
                    misses += 1
                    continue
                misses = 0
                cleared += self._spread_in(s, *found, room)
                spread.append((key, s, found[0]))
                failed.clear()
                continue
            added = float(alone_tiles(s, bins.tile))
            enough = room[:, None] + self.tokens >= s  # [slots, m]
            m = enough.argmax(axis=1)
            tokens, tiles = self.tokens[rows, m], self.tiles[rows, m]
            load = np.asarray(bins.load)[self.rank_of]
            gain = added - tiles
            fits = enough[rows, m] & ((tokens - s) * PAD_TILES <= gain) & (gain > 0) & (load + gain <= top)
            if not fits.any():
                failed.add(s)
                continue
            at = np.flatnonzero(fits)
            slot = int(at[np.lexsort((at, -gain[at], load[at]))[0]])  # the least loaded rank, then most tiles
            r, k = divmod(slot, packs)
            cleared += self._clear(slot, int(m[slot]))
            bins.restore(s, (k, r, 1))
            self.held[slot].append((s, key))
            self.held[slot].sort()
            self._prefix(slot)
            room[slot] = bins.room[r][k]
            placed.add(key)
            failed.clear()
        if placed or spread:
            gone = {key for key, _ in cleared}
            self.step[:] = [piece for piece in self.step if piece[0] not in gone]
            self.step += [(key, s, (slot % packs, slot // packs, 1)) for slot, pieces in enumerate(self.held)
                          for s, key in pieces if key in placed]  # fmt: skip
            self.step += spread
            placed |= {key for key, _, _ in spread}
            self.waiting[:] = [piece for piece in self.waiting if piece[0] not in placed]
        return cleared

    def _spread_in(self, s: int, where: Placement, slots: list[tuple[int, int]], room: np.ndarray
                   ) -> list[tuple[int, int]]:  # fmt: skip
        """Clear each ``(slot, m)`` of its ``m`` shortest whole pieces and spread ``s`` tokens at ``where``
        (:meth:`_spread_place`'s choice), keeping the books' rows and ``room`` those of the step; the pieces
        cleared, ``(key, tokens)``."""
        bins, packs = self.bins, self.bins.packs
        cleared = [piece for slot, m in slots for piece in self._clear(slot, m)]
        bins.restore(s, where)
        for slot, _ in slots:
            self._prefix(slot)
            room[slot] = bins.room[slot // packs][slot % packs]
        return cleared

    def _clear(self, slot: int, m: int) -> list[tuple[int, int]]:
        """Take slot ``slot``'s (``rank * packs + micro-batch``) ``m`` shortest whole pieces out of the step's books
        and its row of held pieces (the caller rebuilds the row's prefixes once it has placed what goes in); the
        pieces, ``(key, tokens)``."""
        r, k = divmod(slot, self.bins.packs)
        out, self.held[slot] = self.held[slot][:m], self.held[slot][m:]
        for length, _ in out:
            self.bins.take_back(length, (k, r, 1))
        return [(key, length) for length, key in out]

    def _spread_place(self, s: int, room: np.ndarray, top: float
                      ) -> tuple[Placement, list[tuple[int, int]]] | None:  # fmt: skip
        """Where a waiting piece of ``s`` tokens, longer than a rank, spreads inside one node in place of cheaper
        whole pieces: ``(placement, [(slot, m)])``, each role's slot cleared of its ``m`` shortest whole pieces
        (fewest that make the role's room); None where none. Every width from its fewest ranks up to a node, every
        window inside a node (no key crosses nodes), either orientation and micro-batch, where each role's rank
        stays at or under the busiest load ``top`` and the step's busiest receiver of keys, and the tokens cleared
        past ``s`` cost no more than the tiles added past the cleared ones (:data:`PAD_TILES`). Of those, the
        least busiest load after it, then the most tiles added; ties: the first width, window, orientation (THD's
        first) and micro-batch."""
        bins, packs = self.bins, self.bins.packs
        load, recv = np.asarray(bins.load), np.asarray(bins.recv, dtype=np.int64)
        cap = int(recv.max())
        best: tuple[tuple[float, float], Placement, list[tuple[int, int]]] | None = None
        for c in range(-(-s // bins.local), min(bins.node_size, bins.world) + 1):
            cut = bins.cut(s, c)
            if cut is None:
                continue
            need, added, keys = cut
            enough = room[:, None, None] + self.tokens[:, None, :] >= need[None, :, None]  # [slots, c, m]
            m = enough.argmax(axis=2)  # [slots, c]: the fewest pieces each role clears on each slot
            ok = np.take_along_axis(enough, m[..., None], axis=2)[..., 0]
            tokens = np.take_along_axis(self.tokens, m, axis=1)
            tiles = np.take_along_axis(self.tiles, m, axis=1)
            starts, at, roles = window_index(bins.world, bins.node_size, c)
            slot = at[None, :, :, None] * packs + np.arange(packs)[None, None, None, :]  # [1, W, c, packs]
            role = np.broadcast_to(roles[:, None, :, None], (2, *slot.shape[1:]))  # [2, W, c, packs]
            slot = np.broadcast_to(slot, role.shape)
            gain = added[role] - tiles[slot, role]
            after = load[at][None, :, :, None] + gain
            fits = (ok[slot, role] & (after <= top) & (recv[at][None, :, :, None] + keys[role] <= cap)).all(axis=2)
            total = gain.sum(axis=2)  # [2, W, packs]
            lost = tokens[slot, role].sum(axis=2) - s
            fits &= (total > 0) & (lost * PAD_TILES <= total)
            o, a, k = np.nonzero(fits)
            if not o.size:
                continue
            score = after.max(axis=2)[o, a, k]
            i = int(np.lexsort((k, o, a, -total[o, a, k], score))[0])
            rank = (float(score[i]), -float(total[o[i], a[i], k[i]]))
            if best is None or rank < best[0]:
                o_i, a_i, k_i = int(o[i]), int(a[i]), int(k[i])
                first = int(starts[a_i])
                where = (k_i, *window_owners(first, c, bool(o_i)))
                slots = [(int(slot[o_i, a_i, p, k_i]), int(m[slot[o_i, a_i, p, k_i], role[o_i, a_i, p, k_i]]))
                         for p in range(c)]  # fmt: skip
                best = (rank, where, slots)
        return None if best is None else (best[1], best[2])
