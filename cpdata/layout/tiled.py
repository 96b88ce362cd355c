"""Layout ``tiled``: whole ``tile``-token blocks of the pack, dealt to balance the tiles a kernel computes.

Each rank gets ``n / cp`` of the pack's ``n = S / tile`` blocks, in increasing order. A block's live tiles do not
depend on who owns the others (:func:`cpdata.layout.tiles.block_tiles`), so only the deal matters
(:mod:`cpdata.layout.tiled_deal`; docs/layouts-and-kernels.md). A row or the inverse is one ``repeat`` and one add.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.layout.runs import _arange, _per_pack
from cpdata.layout.spans import SpanBlock, SpanTable
from cpdata.layout.tiled_deal import RESPLIT_BLOCKS, block_groups, deal_blocks, resplit_pairs, swap_blocks

__all__ = ["DEFAULT_TILE", "TILES", "TiledBlock", "TiledTable", "tiled_block", "tiled_owners"]

TILES: tuple[int, ...] = (64, 128, 256)
"""Tile sizes ``tiled`` supports (the kernel's query and key block: 128 for flash/flex on most GPUs, 256 on newer)."""

DEFAULT_TILE = 128

TiledBlock, TiledTable = SpanBlock, SpanTable
"""``tiled``'s tables: span tables (:mod:`cpdata.layout.spans`), one span per block."""


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


def tiled_block(lens: np.ndarray, counts: np.ndarray | None, pack_len: int, cp_size: int, tile: int) -> SpanBlock:
    """``tiled`` tables of ``P`` packs (``lens`` int64 ``[N]`` checked slot lengths, ``counts`` int64 ``[P]``
    slots per pack, None: one pack): one :func:`tiled_owners` per pack, each block a span."""
    owners = np.concatenate([tiled_owners(pack, pack_len, cp_size, tile) for pack in _per_pack(lens, counts)])
    n, n_packs = pack_len // tile, 1 if counts is None else counts.shape[0]
    starts, lengths = np.tile(_arange(n, tile), n_packs), np.full(n * n_packs, tile, dtype=np.int64)
    return SpanBlock(pack_len, cp_size, lens, counts, starts, lengths, owners, np.full(n_packs, n, dtype=np.int64))
