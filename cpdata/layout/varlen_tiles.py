"""What a varlen (flash) kernel pays per CP rank: each query run of one document tiled by itself.

Varlen kernels tile each ``cu_seq_q`` / ``cu_seq_k`` segment alone, causal bottom-right; a rank's segments are
the runs of its local order with consecutive positions in one slot (:func:`query_runs`), each over its
document's prefix. Square tiles are a model (FA2 / FA3 use ``128 x 64`` to ``128 x 128``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.layout.tiles import segment_starts

__all__ = ["query_runs", "segment_tiles", "varlen_live_tiles"]


def query_runs(pos: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first [N], length [N])`` int64: the maximal runs of one rank's local order with consecutive global
    positions ``pos`` (int64 ``[L]``) and one document start ``start`` (int64 ``[L]``, each token's slot start)."""
    pos, start = np.asarray(pos, dtype=np.int64).reshape(-1), np.asarray(start, dtype=np.int64).reshape(-1)
    if pos.shape != start.shape:
        raise ValueError(f"pos {pos.shape} and start {start.shape} must hold one value per local token")
    if pos.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    cut = np.flatnonzero((np.diff(pos) != 1) | (np.diff(start) != 0)) + 1
    first = np.concatenate([[0], cut]).astype(np.int64)
    return first, np.diff(np.append(first, pos.size)).astype(np.int64)


def segment_tiles(q_len: np.ndarray, k_len: np.ndarray, tile: int, window: int | None = None) -> np.ndarray:
    """int64 ``[N]``: live ``tile x tile`` tiles of each segment of ``q_len`` queries over ``k_len >= q_len`` keys:
    query ``i`` sees keys ``i + d - (window - 1) .. i + d``, ``d = k_len - q_len`` (``window`` None: from 0)."""
    q_len, k_len = np.asarray(q_len, dtype=np.int64).reshape(-1), np.asarray(k_len, dtype=np.int64).reshape(-1)
    if q_len.shape != k_len.shape or (q_len.size and (q_len.min() < 1 or (k_len < q_len).any())):
        raise ValueError(f"segments need k_len >= q_len >= 1, got q_len {q_len[:8]} k_len {k_len[:8]}")
    if tile < 1 or (window is not None and window < 1):
        raise ValueError(f"tile={tile}, window={window}: both must be positive (window None: no window)")
    blocks = -(-q_len // tile)
    seg = np.repeat(np.arange(q_len.size, dtype=np.int64), blocks)
    b = np.arange(seg.size, dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    d = (k_len - q_len)[seg]
    hi = (np.minimum((b + 1) * tile, q_len[seg]) - 1 + d) // tile
    lo = np.zeros_like(hi) if window is None else np.maximum(0, b * tile + d - (window - 1)) // tile
    return np.bincount(seg, hi - lo + 1, minlength=q_len.size).astype(np.int64)


def varlen_live_tiles(rows: np.ndarray, slot_lens: Sequence[int] | np.ndarray, pack_len: int, tile: int
                      ) -> np.ndarray:  # fmt: skip
    """int64 ``[cp]``: live tiles each rank's varlen segments pay; ``rows`` int64 ``[cp, L]``
    (:func:`cpdata.layout.maps.rank_indices`; ``arange(pack_len)[None]``: every slot one segment)."""
    rows = np.asarray(rows, dtype=np.int64)
    slot, starts = segment_starts(slot_lens, pack_len)
    out = np.zeros(rows.shape[0], dtype=np.int64)
    for rank, pos in enumerate(rows):
        start = starts[slot[pos]]
        first, length = query_runs(pos, start)
        keys = pos[first + length - 1] - start[first] + 1
        out[rank] = int(segment_tiles(length, keys, tile).sum())
    return out
