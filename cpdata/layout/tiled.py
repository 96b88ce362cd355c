"""Layout ``tiled``: whole ``tile``-token blocks of the pack, dealt to balance the tiles a kernel computes.

Each rank gets ``n / cp`` of the pack's ``n = S / tile`` blocks, in increasing order. A block's live tiles do not
depend on who owns the others (:func:`cpdata.layout.tiles.block_tiles`), so only the deal matters
(:mod:`cpdata.layout.tiled_deal`; docs/layouts-and-kernels.md). A row or the inverse is one ``repeat`` and one add.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from cpdata.layout.runs import Table, _frozen, _per_pack
from cpdata.layout.tiled_deal import RESPLIT_BLOCKS, block_groups, deal_blocks, resplit_pairs, swap_blocks

__all__ = ["DEFAULT_TILE", "TILES", "TiledBlock", "TiledTable", "tiled_block", "tiled_owners"]

TILES: tuple[int, ...] = (64, 128, 256)
"""Tile sizes ``tiled`` supports (the kernel's query and key block: 128 for flash/flex on most GPUs, 256 on newer)."""

DEFAULT_TILE = 128


def tiled_owners(slot_lens: Sequence[int] | np.ndarray, pack_len: int, cp_size: int, tile: int) -> np.ndarray:
    """int64 ``[pack_len // tile]``: the rank owning each block (validated lengths, ``pack_len % (cp*tile) == 0``)."""
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
    """The ``tiled`` layout of ``P`` packs, with the :class:`~cpdata.layout.runs.RunBlock` verbs: int64 ``[P * n]``
    ``owners`` (each block's rank, pack after pack), ``by_rank`` (the blocks in rank-major order: pack ``p``'s rank
    ``r`` holds ``by_rank[p*n + r*m : p*n + (r+1)*m]``) and ``place``, its inverse."""

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
        return self.slot_counts.tolist()

    def causal_work(self, real: np.ndarray) -> np.ndarray:
        """float64 ``[P, cp]``: :meth:`RunBlock.causal_work <cpdata.layout.runs.RunBlock.causal_work>`."""
        return _causal_work(self.slot_lens, self.slot_counts, np.asarray(real, dtype=np.int64), self.owners,
                            self.pack_len, self.tile, self.cp_size)  # fmt: skip


def _causal_work(lens: np.ndarray, counts: np.ndarray, real: np.ndarray, owners: np.ndarray, p: int, tile: int,
                 cp: int) -> np.ndarray:  # fmt: skip
    """float64 ``[P, cp]``: the doubled work ``2 W(g)`` before every block boundary ``g``, differenced per block
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


class TiledTable(Table):
    """Pack ``p`` of a :class:`TiledBlock`, with the :class:`~cpdata.layout.runs.RunTable` verbs."""

    __slots__ = ("block", "p", "pack_len", "cp_size")

    def __init__(self, block: TiledBlock, p: int) -> None:
        self.block, self.p, self.pack_len, self.cp_size = block, p, block.pack_len, block.cp_size

    @property
    def lens(self) -> np.ndarray:
        """int64 ``[D]``: the pack's slot lengths (a view)."""
        counts = self.block.slot_counts
        first = int(counts[: self.p].sum())
        return self.block.slot_lens[first : first + int(counts[self.p])]

    def causal_work(self, real_lens: np.ndarray) -> np.ndarray:
        """float64 ``[cp]``: :meth:`RunTable.causal_work <cpdata.layout.runs.RunTable.causal_work>`."""
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

    def inverse(self, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len]``: ``inverse[g]`` = position of token ``g`` in the rank-major concatenation."""
        b, tile, n = self.block, self.block.tile, self.pack_len // self.block.tile
        starts = b.place[self.p * n : (self.p + 1) * n] * tile
        starts -= self.p * self.pack_len
        out = np.empty(self.pack_len, dtype=np.int64) if out is None else out
        return np.add(starts.repeat(tile), _within_blocks(n, tile), out=out)


def tiled_block(lens: np.ndarray, counts: np.ndarray | None, pack_len: int, cp_size: int, tile: int) -> TiledBlock:
    """``tiled`` tables of ``P`` packs (``lens`` int64 ``[N]`` checked slot lengths, ``counts`` int64 ``[P]``
    slots per pack, None: one pack): one :func:`tiled_owners` per pack."""
    slot_counts = np.array([lens.shape[0]], dtype=np.int64) if counts is None else counts
    owners = np.concatenate([tiled_owners(pack, pack_len, cp_size, tile) for pack in _per_pack(lens, counts)])
    return TiledBlock(pack_len, cp_size, tile, owners, lens, slot_counts)
