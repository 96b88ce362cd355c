"""Layout ``tiled``: whole ``tile``-token blocks of the pack, dealt to balance the tiles a kernel computes.

The pack's global order is cut into ``n = S / tile`` blocks; every rank gets
``m = n / cp`` of them, in increasing global order (``S`` a multiple of
``cp * tile``; documents need no padding). A rank's query block is then one
block of the global order, whose live key tiles under the document-causal
mask do not depend on who owns the other blocks:
``cost[b] = b - first_block(document of b's first token) + 1``
(:func:`cpdata.layout.tiles.block_tiles`). A rank pays the sum of its blocks'
costs, and the ranks together pay exactly the pack's tiles at cp = 1, so the
only question is the deal. It is solved from the slot lengths alone, the same
on every rank, in ~15 numpy calls per rank:

1. *Groups*: consecutive blocks whose first token lies in the same document
   (a document's blocks; short documents make one-block groups). Each has a
   cost (sum) and a density (cost per block).
2. *Sequence*: the groups sorted by density, densest first (ties in global
   order), each group's blocks in global order.
3. *Deal*: rank ``r`` takes ``x`` blocks from the dense end of what is left
   and ``m - x`` from the sparse end, ``x`` (one vectorized pass over
   ``0..m``) bringing its cost closest to an equal share of what is left; the
   last rank takes the middle. A group is split only where a rank's two cuts
   fall (at most ``2 cp - 2`` splits), so a document's blocks stay on one rank
   unless balance needs it elsewhere; a document longer than a rank's share is
   cut into consecutive runs (one causal prefix each: a run's rank needs the
   document's keys before it, never after).
4. *Swaps*: while the busiest rank is over the ideal by more than
   :data:`SWAP_TOLERANCE`, swap the one block pair between the busiest and the
   idlest rank that brings both closest to their mean (at most
   :data:`MAX_SWAPS`).

Measured (``cpdata bench --sections attention``, docs/layouts-and-kernels.md):
busiest rank's tiles 1.000-1.007 x the ideal at 32K-128K (tile 128; balanced:
1.01-4.4), at most 1.016 at 8K; K/V a rank must receive 0.01-0.18 of an
all-gather's for short-document mixes, 0.4-0.6 for long_context; 150-430 us of
CPU per pack on a loaded 2-core machine (balanced: 55-640 us).
The tables (:func:`tiled_block`) keep the blocks' owners and their rank-major
order: a rank's row and the inverse map are one ``repeat`` and one add each.
They have the run tables' interface (``tables()``, ``row``, ``inverse``,
``causal_work``), which is all the worker asks of a layout.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from cpdata.layout.runs import _frozen, segments

__all__ = ["DEFAULT_TILE", "MAX_SWAPS", "SWAP_TOLERANCE", "TILES", "TiledBlock", "TiledTable", "block_costs", "tiled_block",
           "tiled_owners"]

TILES: tuple[int, ...] = (64, 128, 256)
"""Tile sizes ``tiled`` supports (the kernel's query and key block: 128 for flash/flex on most GPUs, 256 on newer)."""

DEFAULT_TILE = 128

SWAP_TOLERANCE = 0.005
"""Swaps stop once the busiest rank is within this fraction of the ideal (each swap moves blocks off their
document's rank; the deal alone is within ~1 %)."""

MAX_SWAPS = 16

ALL_PAIRS = 4096
"""Swaps consider every rank's blocks when ``m * (n - m)`` is at most this (8K at cp 8, tile 256: 4 blocks per
rank, 1.04 x ideal with the idlest rank's blocks only, 1.00x with all); larger deals are within ~1 % already."""

PIECE_DIVISOR = 1
"""Documents longer than ``m / PIECE_DIVISOR`` blocks are dealt as consecutive pieces of that many blocks (1:
measured lowest K/V received on long_context, 0.49-0.51 of an all-gather against 0.53-0.55 with 2; balance the
same)."""


def block_costs(slot_lens: np.ndarray, pack_len: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cost, within)`` int64 ``[pack_len // tile]``: each block's live key tiles, and its index among the
    blocks whose first token lies in the same document (0: the first of them).

    ``slot_lens`` int64 ``[D]`` summing to at most ``pack_len`` (the tail joins the last slot). The document
    of block ``b``'s first token starts at ``s``: ``cost = b - s // tile + 1``, and its first such block is
    ``ceil(s / tile)``.
    """
    ends = np.cumsum(slot_lens)
    starts = np.zeros(max(ends.size, 1), dtype=np.int64)
    if ends.size > 1:
        starts[1:] = ends[:-1]
    b = np.arange(pack_len // tile, dtype=np.int64)
    start = starts[np.minimum(ends.searchsorted(b * tile, side="right"), starts.size - 1)]
    head, part = np.divmod(start, tile)
    cost = b - head
    cost += 1
    return cost, cost - 1 - (part > 0)


def _deal(cost: np.ndarray, within: np.ndarray, cp: int) -> np.ndarray:
    """int64 ``[n]``: the owner of every block (steps 1-3 of the module docstring)."""
    n = cost.shape[0]
    m = n // cp
    piece = max(1, m // PIECE_DIVISOR)
    # groups: a document's blocks, in pieces of at most `piece` blocks; costs rise by 1 per block of a group,
    # so a group's density is its first cost plus (size - 1) / 2: doubled, an integer
    first = np.flatnonzero(within % piece == 0)
    size = np.diff(first, append=n)
    twice = cost[first] * 2 + size
    order = np.argsort(-twice, kind="stable")  # densest first, ties in global order
    seq = segments(first[order], size[order])
    cs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(cost[seq], out=cs[1:])
    lo, hi = 0, n
    took = []  # blocks each rank takes from the dense end
    for r in range(cp - 1):
        share = (cs[hi] - cs[lo]) / (cp - r)
        # x from the dense end and m - x from the sparse end cost cs[lo + x] - cs[lo] + cs[hi] - cs[hi - m + x]
        miss = cs[lo : lo + m + 1] - cs[hi - m : hi + 1] + (cs[hi] - cs[lo] - share)  # float64 [m + 1]
        k = int(np.abs(miss).argmin())
        took.append(k)
        lo, hi = lo + k, hi - m + k
    # the sequence, in order: rank 0's dense blocks .. rank cp-2's, the last rank's middle, rank cp-2's sparse
    # blocks .. rank 0's
    counts = np.array([*took, hi - lo, *(m - k for k in reversed(took))], dtype=np.int64)
    owner = np.empty(n, dtype=np.int64)
    owner[seq] = _SNAKE[cp].repeat(counts)
    return owner


class _Snake(dict):
    """``cp`` -> int64 ``[2cp - 1]``: ``0 .. cp-1 .. 0`` (cached)."""

    def __missing__(self, cp: int) -> np.ndarray:
        ranks = np.arange(cp, dtype=np.int64)
        self[cp] = out = np.concatenate([ranks, ranks[-2::-1]])
        return out


_SNAKE = _Snake()


def _swap(cost: np.ndarray, owner: np.ndarray, cp: int) -> None:
    """Step 4, in place: swap one block of the busiest rank with one of another rank, the pair that lowers the
    larger of their two loads most, until the busiest is within :data:`SWAP_TOLERANCE` of the ideal. While
    ``m * (n - m) <= ALL_PAIRS`` (few blocks per rank, where the deal's granularity shows) every other rank's
    blocks are candidates and swaps go on while one helps; above that, the idlest rank's blocks only."""
    load = np.bincount(owner, cost, minlength=cp).astype(np.int64)
    ideal = load.sum() / cp
    n = cost.shape[0]
    every = (n // cp) * (n - n // cp) <= ALL_PAIRS
    limit = ideal if every else ideal * (1 + SWAP_TOLERANCE)  # small deals: swap while any pair helps
    for _ in range(MAX_SWAPS):
        a = int(load.argmax())
        if load[a] <= limit:
            return
        mine = owner == a
        on_a = np.flatnonzero(mine)
        others = np.flatnonzero(~mine) if every else np.flatnonzero(owner == int(load.argmin()))
        delta = cost[on_a][:, None] - cost[others][None, :]  # [m, k]: load moved from a to the other rank
        after = np.maximum(load[a] - delta, load[owner[others]][None, :] + delta)
        after[delta <= 0] = load[a]
        best = int(after.argmin())
        i, j = divmod(best, others.shape[0])
        if after[i, j] >= load[a]:
            return
        ia, ib = on_a[i], others[j]
        b = int(owner[ib])
        owner[ia], owner[ib] = b, a
        load[a] -= delta[i, j]
        load[b] += delta[i, j]


def tiled_owners(slot_lens: Sequence[int] | np.ndarray, pack_len: int, cp_size: int, tile: int) -> np.ndarray:
    """int64 ``[pack_len // tile]``: the rank owning each block (validated lengths, ``pack_len % (cp*tile) == 0``)."""
    lens = np.asarray(slot_lens, dtype=np.int64).reshape(-1)
    cost, within = block_costs(lens, pack_len, tile)
    if cp_size == 1 or cost.shape[0] == 0:
        return np.zeros(cost.shape[0], dtype=np.int64)
    owner = _deal(cost, within, cp_size)
    _swap(cost, owner, cp_size)
    return owner


@functools.lru_cache(maxsize=16)
def _within_blocks(n_blocks: int, tile: int) -> np.ndarray:
    """int64 ``[n_blocks * tile]``: ``0 .. tile-1`` repeated (read-only, cached)."""
    out = np.tile(np.arange(tile, dtype=np.int64), n_blocks)
    _frozen(out)
    return out


class TiledBlock:
    """The ``tiled`` layout of ``P`` packs: the :class:`~cpdata.layout.runs.RunBlock` interface
    (:meth:`tables`, :meth:`causal_work`, :meth:`doc_counts`) over the blocks' owners.

    Attributes:
        pack_len, cp_size, tile: the packs' shape.
        owners: int64 ``[P * n]``: each block's rank, pack after pack (``n = pack_len / tile``).
        by_rank: int64 ``[P * n]``: the blocks (block-global indices) in rank-major order: pack ``p``'s rank ``r``
            holds ``by_rank[p*n + r*m : p*n + (r+1)*m]``, in increasing order (``m = n / cp``).
        place: int64 ``[P * n]``: the inverse of ``by_rank``.
        slot_lens, slot_counts: the packs' slot lengths int64 ``[N]`` and slots per pack int64 ``[P]``.
    """

    __slots__ = ("pack_len", "cp_size", "tile", "owners", "by_rank", "place", "slot_lens", "slot_counts")

    def __init__(self, pack_len: int, cp_size: int, tile: int, owners: np.ndarray, slot_lens: np.ndarray,
                 slot_counts: np.ndarray) -> None:  # fmt: skip
        n = pack_len // tile
        n_packs = slot_counts.shape[0]
        self.pack_len, self.cp_size, self.tile, self.owners = pack_len, cp_size, tile, owners
        self.slot_lens, self.slot_counts = slot_lens, slot_counts
        key = owners if n_packs == 1 else owners + np.arange(n_packs, dtype=np.int64).repeat(n) * cp_size
        self.by_rank = np.argsort(key, kind="stable")
        self.place = np.empty_like(self.by_rank)
        self.place[self.by_rank] = np.arange(n_packs * n, dtype=np.int64)

    def tables(self) -> list[TiledTable]:
        """One :class:`TiledTable` per pack."""
        return [TiledTable(self, p) for p in range(self.slot_counts.shape[0])]

    def doc_counts(self) -> list[int]:
        """Slots of each pack (what :meth:`causal_work` takes a real length for)."""
        return self.slot_counts.tolist()

    def causal_work(self, real: np.ndarray) -> np.ndarray:
        """float64 ``[P, cp]``: causal document-masked work per rank (a real token at document offset ``o``
        costs ``o + 1``, padding 0); ``real`` int64 ``[N]``: real tokens of each slot, pack after pack."""
        return _causal_work(self.slot_lens, self.slot_counts, np.asarray(real, dtype=np.int64), self.owners,
                            self.pack_len, self.tile, self.cp_size)  # fmt: skip

    def pack_slots(self, p: int) -> np.ndarray:
        """int64 ``[D_p]``: pack ``p``'s slot lengths (a view)."""
        first = int(self.slot_counts[:p].sum())
        return self.slot_lens[first : first + int(self.slot_counts[p])]


def _causal_work(lens: np.ndarray, counts: np.ndarray, real: np.ndarray, owners: np.ndarray, p: int, tile: int,
                 cp: int) -> np.ndarray:  # fmt: skip
    """float64 ``[P, cp]`` (see :meth:`TiledBlock.causal_work`): ``2 W(g)``, the doubled work of the block's
    positions before ``g``, at every block boundary (one search over the slot starts), differenced per block
    and summed per owner with one ``bincount``."""
    n_packs = counts.shape[0]
    if lens.size == 0:
        return np.zeros((n_packs, cp), dtype=np.float64)
    ends = np.cumsum(lens)
    before = np.concatenate([[0], ends])[np.cumsum(counts) - counts]  # slot tokens before each pack
    # slot starts in the block's packs laid back to back, pack i at i * p
    offsets = ends - lens + np.repeat(np.arange(n_packs, dtype=np.int64) * p - before, counts)
    twice = real * (real + 1)
    below = np.cumsum(twice) - twice  # 2 W(each slot's start)
    nb = p // tile
    at = (np.arange(n_packs, dtype=np.int64)[:, None] * p + np.arange(nb + 1, dtype=np.int64) * tile).reshape(-1)
    k = np.maximum(offsets.searchsorted(at, side="right") - 1, 0)
    into = np.clip(at - offsets[k], 0, real[k])
    w = (below[k] + into * (into + 1)).reshape(n_packs, nb + 1)  # 2 W(each block boundary)
    per_block = (w[:, 1:] - w[:, :-1]).reshape(-1)
    keys = owners + np.repeat(np.arange(n_packs, dtype=np.int64) * cp, nb)
    return (np.bincount(keys, per_block, minlength=n_packs * cp) / 2).reshape(n_packs, cp)


class TiledTable:
    """Pack ``p`` of a :class:`TiledBlock`: the :class:`~cpdata.layout.runs.RunTable` verbs ``row`` and
    ``inverse``, each one ``repeat`` and one add."""

    __slots__ = ("block", "p", "pack_len", "cp_size")

    def __init__(self, block: TiledBlock, p: int) -> None:
        self.block, self.p, self.pack_len, self.cp_size = block, p, block.pack_len, block.cp_size

    @property
    def lens(self) -> np.ndarray:
        """int64 ``[D]``: the pack's slot lengths."""
        return self.block.pack_slots(self.p)

    @property
    def doc(self) -> np.ndarray:
        """int64 ``[D]``: the slot of each document (``arange(D)``, as for the run tables)."""
        return np.arange(self.lens.shape[0], dtype=np.int64)

    @property
    def doc_starts(self) -> np.ndarray:
        """int64 ``[D]``: global offset of each slot."""
        lens = self.lens
        return np.cumsum(lens) - lens

    def causal_work(self, real_lens: np.ndarray) -> np.ndarray:
        """float64 ``[cp]``: causal document-masked work per rank (``real_lens`` int64 ``[>= D]``, the first
        ``D`` used)."""
        lens, b, n = self.lens, self.block, self.pack_len // self.block.tile
        real = np.asarray(real_lens, dtype=np.int64)[: lens.shape[0]]
        owners = b.owners[self.p * n : (self.p + 1) * n]
        counts = np.array([lens.shape[0]], dtype=np.int64)
        return _causal_work(lens, counts, real, owners, self.pack_len, b.tile, self.cp_size)[0]

    def row(self, rank: int, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len / cp]``: rank ``rank``'s blocks in increasing order, token by token (into ``out``)."""
        b, tile, n = self.block, self.block.tile, self.pack_len // self.block.tile
        m = n // self.cp_size
        lo = self.p * n + rank * m
        starts = b.by_rank[lo : lo + m] * tile
        starts -= self.p * self.pack_len
        out = np.empty(m * tile, dtype=np.int64) if out is None else out
        return np.add(starts.repeat(tile), _within_blocks(m, tile), out=out)

    def rows(self) -> np.ndarray:
        """int64 ``[cp, pack_len / cp]``: every rank's row."""
        out = np.empty((self.cp_size, self.pack_len // self.cp_size), dtype=np.int64)
        for r in range(self.cp_size):
            self.row(r, out[r])
        return out

    def inverse(self, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len]``: ``inverse[g]`` = position of token ``g`` in the rank-major concatenation."""
        b, tile, n = self.block, self.block.tile, self.pack_len // self.block.tile
        starts = b.place[self.p * n : (self.p + 1) * n] * tile
        starts -= self.p * self.pack_len
        out = np.empty(self.pack_len, dtype=np.int64) if out is None else out
        return np.add(starts.repeat(tile), _within_blocks(n, tile), out=out)


def tiled_block(lens: np.ndarray, counts: np.ndarray | None, pack_len: int, cp_size: int, tile: int) -> TiledBlock:
    """``tiled`` tables of ``P`` packs (``lens`` int64 ``[N]`` checked slot lengths, ``counts`` int64 ``[P]``
    slots per pack, None: one pack): one :func:`tiled_owners` per pack, then one stable sort of the owners."""
    if counts is None:
        packs, slot_counts = [lens], np.array([lens.shape[0]], dtype=np.int64)
    else:
        packs, slot_counts = np.split(lens, np.cumsum(counts)[:-1]), counts
    owners = tiled_owners(packs[0], pack_len, cp_size, tile) if len(packs) == 1 else np.concatenate(
        [tiled_owners(pack, pack_len, cp_size, tile) for pack in packs])  # fmt: skip
    return TiledBlock(pack_len, cp_size, tile, owners, lens, slot_counts)
