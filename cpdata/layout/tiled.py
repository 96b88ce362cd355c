"""Layout ``tiled``: whole ``tile``-token blocks of the pack, dealt to balance the tiles a kernel computes.

The pack's global order is cut into ``n = S / tile`` blocks; every rank gets
``m = n / cp`` of them, in increasing global order (``S`` a multiple of
``cp * tile``; documents need no padding). A rank's query block is then one
block of the global order, whose live key tiles under the document-causal
mask do not depend on who owns the other blocks:
``cost[b] = b - first_block(document of b's first token) + 1``
(:func:`cpdata.layout.tiles.block_tiles`). A rank pays the sum of its blocks'
costs, and the ranks together pay exactly the pack's tiles at cp = 1, so the
only question is the deal (:mod:`cpdata.layout.tiled_deal`), solved from the
slot lengths alone, the same on every rank: each document's blocks are a
group (long ones cut into a cheap head and a dense tail); the groups, densest
first and each tail first, are dealt so that every rank takes a run from the
dense end and one from the sparse end, the split closest to an equal share (one
block from deeper in the piece its run ends in fills the gap where a dense block
is coarser than 0.25 % of the share); swaps that raise the most K/V any rank
receives least bring the busiest rank within 0.5 % of the ideal, and pairwise
re-splits finish deals of at most 4 blocks a rank. A rank that holds a run of a
document needs the document's keys before it: the deal keeps documents in few
runs and gives a long document's tail and head to one rank.

Measured (``cpdata bench --sections attention``, 450 rows, docs/layouts-and-kernels.md): the busiest rank's
tiles are 1.000-1.007 x the ideal at 32K-128K (tile 128; 1.000-1.014 at 256; balanced: 1.01-4.4) and within
0.05 % of the integer bound ``max(ceil(tiles / cp), costliest block)`` on every 8K row (at most 1.016 at tile
128; 1.0245 on ultrachat cp 8 tile 256, where a rank holds 4 blocks); the rank that needs most K/V receives
0.01-0.18 of an all-gather's for short-document mixes and 0.37-0.47 for long_context at 32K-128K (2 of its 10
packs at 32K are one document, where whoever owns the last block needs all of it); 53-74 us of CPU per pack at
32K cp 4 and 81-150 us at 128K cp 8 (tile 128; balanced: 29-50 and 30-207 us). A deal by density alone, with
documents cut every ``m`` blocks and swaps blind to K/V, measured 86-214 and 160-296 us and 0.43-0.60 on
long_context at 32K on the same machine.

The tables (:func:`tiled_block`) keep the blocks' owners and their rank-major
order: a rank's row and the inverse map are one ``repeat`` and one add each.
They have the run tables' interface (``tables()``, ``row``, ``inverse``,
``causal_work``), which is all the worker asks of a layout.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from cpdata.layout.runs import _frozen, stacked_rows
from cpdata.layout.tiled_deal import RESPLIT_BLOCKS, block_groups, deal_blocks, resplit_pairs, swap_blocks

__all__ = ["DEFAULT_TILE", "TILES", "TiledBlock", "TiledTable", "tiled_block", "tiled_owners"]

TILES: tuple[int, ...] = (64, 128, 256)
"""Tile sizes ``tiled`` supports (the kernel's query and key block: 128 for flash/flex on most GPUs, 256 on newer)."""

DEFAULT_TILE = 128


def tiled_owners(slot_lens: Sequence[int] | np.ndarray, pack_len: int, cp_size: int, tile: int) -> np.ndarray:
    """int64 ``[pack_len // tile]``: the rank owning each block (validated lengths, ``pack_len % (cp*tile) == 0``;
    :mod:`cpdata.layout.tiled_deal`)."""
    n = pack_len // tile
    if cp_size == 1 or n == 0:
        return np.zeros(n, dtype=np.int64)
    first, size, c0 = block_groups(np.asarray(slot_lens, dtype=np.int64).reshape(-1), pack_len, tile)
    owner, loads = deal_blocks(first, size, c0, n, cp_size)
    swap_blocks(first, size, c0, owner, cp_size, loads)
    if n // cp_size <= RESPLIT_BLOCKS:
        resplit_pairs(first, size, c0, owner, cp_size)
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
        self.by_rank = key.argsort(kind="stable")
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
        return stacked_rows(self)

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
