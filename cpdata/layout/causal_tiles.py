"""The live ``tile x tile`` tiles of causal segments: one varlen kernel call's work over a query run and the
keys before it (the one counter both the tile layouts and the world step's cut price pieces with)."""

from __future__ import annotations

import numpy as np

from cpdata.errors import check_int
from cpdata.layout.runs import segments

__all__ = ["segment_tiles", "span_tiles"]


def segment_tiles(q_len: np.ndarray, k_len: np.ndarray, tile: int, window: int | None = None) -> np.ndarray:
    """int64 ``[N]``: live ``tile x tile`` tiles of each segment of ``q_len`` queries over ``k_len >= q_len`` keys:
    query ``i`` sees keys ``i + d - (window - 1) .. i + d``, ``d = k_len - q_len`` (``window`` None: from 0)."""
    q_len, k_len = np.asarray(q_len, dtype=np.int64).reshape(-1), np.asarray(k_len, dtype=np.int64).reshape(-1)
    if q_len.shape != k_len.shape or (q_len.size and (q_len.min() < 1 or (k_len < q_len).any())):
        raise ValueError(f"segments need k_len >= q_len >= 1, got q_len {q_len[:8]} k_len {k_len[:8]}")
    check_int("tile", tile, min=1)
    check_int("window", window, min=1, optional=True, fix=" (None: no window)")
    blocks = -(-q_len // tile)
    seg = np.repeat(np.arange(q_len.size, dtype=np.int64), blocks)
    b = segments(np.zeros_like(blocks), blocks)  # the block's index in its segment
    d = (k_len - q_len)[seg]
    hi = (np.minimum((b + 1) * tile, q_len[seg]) - 1 + d) // tile
    lo = np.zeros_like(hi) if window is None else np.maximum(0, b * tile + d - (window - 1)) // tile
    return np.bincount(seg, hi - lo + 1, minlength=q_len.size).astype(np.int64)


def span_tiles(p: int | np.ndarray, q: int | np.ndarray, tile: int) -> int | np.ndarray:
    """Live tiles of the causal segment of queries ``p .. q - 1`` over the keys ``0 .. q - 1``, its query blocks
    tiled from ``p`` (:func:`segment_tiles` of one segment, ``q_len = q - p``, ``k_len = q``), in closed form:
    ints or int64 arrays alike, elementwise. Needs ``q > p``: the callers give an empty span no tiles."""
    blocks = -(-(q - p) // tile)
    return (blocks - 1) * (blocks - 2) // 2 + (blocks - 1) * (2 + (p - 1) // tile) + (q - 1) // tile + 1
