"""The world plan: ``W`` per-rank bins of ``L = S / W`` tokens, shared by the world packer and the world deal.

- a document of at most ``L`` tokens goes whole into the least loaded bin (predicted tiles,
  :func:`grid_tiles`; ties: the lowest rank) with room for it: it receives no keys;
- a longer one spans ``c = ceil(s / L)`` consecutive ranks (up to ``2c`` when no ``c`` ranks have room for its
  pieces), inside one node when ``c <= node_size``, the window of ranks whose summed load is least, in TE
  THD's ``2c`` chunks (rank ``i`` of the ``c`` takes chunks ``i`` and ``2c - 1 - i``).

Documents are placed longest first (ties: slot order), and a placement depends only on the bins' state and
the piece's length: :func:`plan_runs` replaying a packed micro-batch's slots puts every document where the
packer (:class:`cpdata.packing.decreasing.WorldPacker`, through :class:`WorldBins`) did, from the slot lengths
alone (no side channel through the pipeline). Slots from another packer may not fit: :func:`plan_runs`
returns None and :func:`~cpdata.layout.world_deal.world_runs` cuts.

Trade-off: bins balance tokens first (every rank at most ``L``) and tiles second; a micro-batch of a few
dense documents among many short ones can leave one rank busier than the mean (``cpdata bench --sections
world``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np

__all__ = ["WorldBins", "alone_tiles", "chunk_need", "chunk_runs", "grid_tiles", "plan_runs", "thd_chunks", "thd_need",
           "thd_runs"]


def thd_chunks(s: int, c: int) -> list[int]:
    """``2c`` near-equal chunk lengths of ``s`` (the longer ones first)."""
    q, r = divmod(s, 2 * c)
    return [q + 1] * r + [q] * (2 * c - r)


def chunk_need(chunk: Sequence[int]) -> tuple[int, ...]:
    """Tokens each of the ``c`` ranks of a document cut in ``2c`` chunks holds (rank ``i``: chunks ``i`` and
    ``2c - 1 - i``)."""
    c = len(chunk) // 2
    return tuple(chunk[i] + chunk[2 * c - 1 - i] for i in range(c))


def chunk_runs(chunk: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(offset in the document, length, i)`` of every non-empty chunk of ``2c``, rank ``i`` of the ``c`` taking
    chunks ``i`` then ``2c - 1 - i``, rank after rank."""
    c = len(chunk) // 2
    starts = list(itertools.accumulate(chunk, initial=0))
    return [(starts[j], chunk[j], i) for i in range(c) for j in (i, 2 * c - 1 - i) if chunk[j]]


def thd_need(s: int, c: int) -> tuple[int, ...]:
    """Tokens each of ``c`` ranks holds of ``s`` in :func:`thd_chunks` (:func:`chunk_need`)."""
    return chunk_need(thd_chunks(s, c))


def thd_runs(s: int, c: int) -> list[tuple[int, int, int]]:
    """The runs of :func:`thd_chunks` (:func:`chunk_runs`)."""
    return chunk_runs(thd_chunks(s, c))


def alone_tiles(length: int | np.ndarray, tile: int) -> int | np.ndarray:
    """Live tiles of one causal document of ``length`` tokens tiled by itself: ``nb (nb + 1) / 2`` (of each, where
    ``length`` is an int64 array)."""
    nb = -(-length // tile)
    return nb * (nb + 1) // 2


def grid_tiles(length: int, tile: int) -> float:
    """Expected live tiles of a document of ``length`` tokens at a uniformly random offset in a stream of
    documents cut into ``tile``-token blocks (a rank's local order under a stream-grid kernel):
    ``x (x + 3) / 2`` for ``x = length / tile``. A query block costs from the first key block of the document
    its first token lies in up to itself (:func:`cpdata.layout.tiles.block_tiles`), so a document pays for
    the blocks whose first token it holds: ``k (k + 1) / 2`` when it starts on a block boundary, ``k (k + 3) /
    2`` otherwise, for ``k = x`` whole blocks; a short document pays 2 with probability ``x``."""
    x = length / tile
    return x * (x + 3) / 2


class WorldBins:
    """``world`` per-rank bins of ``local`` tokens (``node_size`` ranks per node); :meth:`place` adds one
    document and records its runs ``(offset in the document, length, rank)``; the ``world`` deal
    (:func:`~cpdata.layout.world_deal.world_runs`) keeps its ranks' room and load in one too."""

    __slots__ = ("local", "world", "node_size", "tile", "room", "load", "max_room", "total_room", "_heap", "_version")

    def __init__(self, local: int, world: int, node_size: int, tile: int = 128) -> None:
        self.local, self.world, self.node_size, self.tile = local, world, node_size, tile
        self.room = [local] * world
        self.load = [0.0] * world
        self.max_room = local
        self.total_room = local * world
        self._heap = [(0.0, r, 0) for r in range(world)]  # (load, rank, version): a valid heap as built
        self._version = [0] * world

    def place(self, s: int) -> list[tuple[int, int, int]] | None:
        """Place a document of ``s`` tokens; its runs ``(offset, length, rank)``, or None (state unchanged)
        when it does not fit."""
        if s <= self.local:  # whole, or not in this micro-batch
            if s > self.max_room:
                return None
            best = self.least_loaded(s)
            self.take(best, s, grid_tiles(s, self.tile))
            return [(0, s, best)] if s else []
        if s > self.total_room:
            return None
        fewest = max(2, -(-s // self.local))
        most = min(self.world, 2 * fewest)
        least_need = s // most - 1  # no rank of any c in [fewest, most] takes fewer tokens
        if sum(room >= least_need for room in self.room) < fewest:
            return None  # (a necessary condition, checked at once)
        spreads = (self._spread(s, c) for c in range(fewest, most + 1))  # more ranks only while pieces shrink
        return next((runs for runs in spreads if runs is not None), None)

    def _spread(self, s: int, c: int) -> list[tuple[int, int, int]] | None:
        need = thd_need(s, c)
        nodes = -(-c // self.node_size)
        fits = [a for a in range(self.world - c + 1)
                if (a + c - 1) // self.node_size - a // self.node_size < nodes
                and all(self.room[a + i] >= need[i] for i in range(c))]  # fmt: skip
        if not fits:
            return None
        best = min(fits, key=lambda a: sum(self.load[a : a + c]))  # the least loaded window (ties: the first)
        return self.take_thd(s, list(range(best, best + c)))

    def take_thd(self, s: int, ranks: list[int]) -> list[tuple[int, int, int]]:
        """Take a document of ``s`` tokens over the ``c`` ``ranks`` in TE THD's ``2c`` chunks (the ``i``-th rank:
        chunks ``i`` and ``2c - 1 - i``, and ``1 / c`` of its tiles); its runs ``(offset, length, rank)``."""
        c = len(ranks)
        share = grid_tiles(s, self.tile) / c
        for r, n in zip(ranks, thd_need(s, c), strict=True):
            self.take(r, n, share)
        return [(offset, n, ranks[i]) for offset, n, i in thd_runs(s, c)]

    def least_loaded(self, s: int) -> int:
        """The least loaded rank (ties: the lowest) with room for ``s`` tokens (one exists: ``s <= max_room``).
        A heap of ``(load, rank, version)``; an entry whose version is not the rank's is stale."""
        aside = []
        heap = self._heap
        while True:
            entry = heapq.heappop(heap)
            r = entry[1]
            if entry[2] != self._version[r]:
                continue
            if self.room[r] >= s:
                break
            aside.append(entry)
        for entry in aside:
            heapq.heappush(heap, entry)
        return r

    def take(self, r: int, s: int, tiles: float) -> None:
        """Give rank ``r`` ``s`` tokens costing ``tiles``."""
        full = self.room[r] == self.max_room
        self.room[r] -= s
        self.total_room -= s
        self.load[r] += tiles
        self._version[r] += 1
        heapq.heappush(self._heap, (self.load[r], r, self._version[r]))
        if full and s:
            self.max_room = max(self.room)


def plan_runs(slot_lens: np.ndarray, pack_len: int, world: int, node_size: int, tile: int = 128
              ) -> list[tuple[int, int, int]] | None:  # fmt: skip
    """Replay the plan over one micro-batch: runs ``(global start, length, rank)`` of its documents (no pad),
    or None when some document finds no room (the slots were not packed by the world packer).

    ``slot_lens`` int64 ``[D]`` summing to at most ``pack_len``; documents are placed longest first, ties in
    slot order, as the packer placed them.
    """
    lens = slot_lens.tolist()
    offsets = list(itertools.accumulate(lens, initial=0))
    bins = WorldBins(pack_len // world, world, node_size, tile)
    runs: list[tuple[int, int, int]] = []
    for d in sorted(range(len(lens)), key=lambda d: -lens[d]):
        placed = bins.place(lens[d])
        if placed is None:
            return None
        runs += [(offsets[d] + o, n, r) for o, n, r in placed]
    return runs
