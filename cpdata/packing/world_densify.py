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
or are topped up elsewhere by the packer. Trade-off: a search over every rank and
micro-batch per document (one array pass), at most :data:`DENSIFY_TRIES` documents a close, and none once the
step stands within :data:`DENSIFY_OVER` of its mean; a document of a length that found no place is not tried again
at that length until one is placed.
"""

from __future__ import annotations

import numpy as np

from cpdata.layout.world_cost import H100_DEFAULTS
from cpdata.layout.world_owners import Placement
from cpdata.layout.world_plan import alone_tiles
from cpdata.layout.world_step import StepBins

__all__ = ["DENSIFY_OVER", "DENSIFY_TRIES", "PAD_TILES", "Densify"]

DENSIFY_OVER, DENSIFY_TRIES = 0.005, 128
"""Closing, the step's ranks take dearer waiting documents while it stands more than this fraction over its mean
rank, at most this many waiting documents tried (:class:`Densify`)."""

PAD_TILES = H100_DEFAULTS.per_position_seconds / H100_DEFAULTS.per_tile_seconds
"""Tiles a position of pad costs (a position through the linear layers against a live tile, the cost model's H100
defaults: 1.03): a swap's tokens cleared past the document's own, times this, are at most the tiles it adds past
the cleared ones. The defaults' ratio, not a calibration file's: a ``world`` layout string carries only the keys'
prices."""


class Densify:
    """Waiting whole documents swapped into a closing step in place of cheaper whole documents, on ranks under the
    busiest (the module docstring). ``step`` (``(key, tokens, placement)``) and ``waiting`` (``(key, tokens)``) are
    the packer's lists, changed in place; :meth:`run` returns the documents it cleared, which the caller offers to
    the step again or keeps waiting."""

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
        candidates = sorted((piece for piece in self.waiting if piece[1] <= local), key=lambda p: (-p[1], p[0]))
        if not candidates:
            return []
        self._books()
        room = np.array(bins.room, dtype=np.float64).reshape(-1)  # [world * packs], kept as slots change
        rows = np.arange(len(self.held))
        cleared: list[tuple[int, int]] = []
        placed: set[int] = set()
        failed: set[int] = set()  # lengths that found no place since the last swap
        top = bins.busiest_load
        for key, s in candidates[:DENSIFY_TRIES]:
            if not bins.over(DENSIFY_OVER):
                break
            if s in failed:
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
            out, self.held[slot] = self.held[slot][: m[slot]], self.held[slot][m[slot]:]
            for length, other in out:
                bins.take_back(length, (k, r, 1))
                cleared.append((other, length))
            bins.restore(s, (k, r, 1))
            self.held[slot].append((s, key))
            self.held[slot].sort()
            self._prefix(slot)
            room[slot] = bins.room[r][k]
            placed.add(key)
            failed.clear()
        if placed:
            gone = {key for key, _ in cleared}
            self.step[:] = [piece for piece in self.step if piece[0] not in gone]
            self.step += [(key, s, (slot % packs, slot // packs, 1)) for slot, pieces in enumerate(self.held)
                          for s, key in pieces if key in placed]  # fmt: skip
            self.waiting[:] = [piece for piece in self.waiting if piece[0] not in placed]
        return cleared
