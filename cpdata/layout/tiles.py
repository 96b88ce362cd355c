"""What a kernel pays per CP rank: block-sparse live tiles and the K/V a rank receives, varlen tiles.

Under the document-causal mask (:mod:`cpdata.device.attention_masks`; a tail pad attends to its own key only), a rank's
queries are its row in local order and the keys the pack in global order, both cut into ``tile``-token blocks;
a tile is live when any pair in it attends, and flash / flex kernels pay it in full. :func:`live_tiles` and
:func:`kv_recv_tokens` sort the ``S`` tokens (O(S log S)): references for tests, benchmarks and inspection.

Varlen kernels tile each ``cu_seq_q`` / ``cu_seq_k`` segment alone, causal bottom-right; a rank's segments are
the runs of its local order with consecutive positions in one slot (:func:`query_runs`), each over its
document's prefix (:func:`varlen_live_tiles`). Square tiles are a model (FA2 / FA3: 128 x 64 to 128).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from cpdata.layout.causal_tiles import segment_tiles
from cpdata.layout.maps import _absorb_tail, _lengths_in_pack
from cpdata.layout.runs import segments

if TYPE_CHECKING:
    from cpdata.layout.exchange import ExchangePlan

__all__ = ["PAD_CHUNK", "block_tiles", "exchange_tiles", "first_keys", "ideal_tiles", "kv_recv_tokens", "live_tiles",
           "kept_queries", "pad_cut_runs", "query_runs", "segment_starts", "varlen_live_tiles"]

PAD_CHUNK = 128
"""Pad queries before a rank's last real one run as segments of at most this many queries over their own keys
(:mod:`cpdata.device.varlen`; its trailing pad is not run); the counters here cut pad runs the same way."""


def segment_starts(slot_lens: Sequence[int] | np.ndarray, pack_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Every token's slot and every slot's start: ``(slot int64 [pack_len], start int64 [K])``; the tail padding
    joins the last slot, as in TE's slot tables (:func:`~cpdata.layout.maps.thd_slot_lens`)."""
    lens = _absorb_tail(_lengths_in_pack(slot_lens, pack_len, "slot_lens")[0], pack_len)
    return np.repeat(np.arange(lens.size, dtype=np.int64), lens), np.cumsum(lens) - lens


def first_keys(slot_lens: Sequence[int] | np.ndarray, pack_len: int) -> np.ndarray:
    """int64 ``[pack_len]``: the first key each query attends to: its slot's start for a document token, the
    query itself for the tail padding (a pad query sees its own key only). Query ``q`` attends to the keys
    ``first_keys[q] <= k <= q``."""
    lens, end = _lengths_in_pack(slot_lens, pack_len, "slot_lens")
    out = np.arange(pack_len, dtype=np.int64)
    out[:end] = np.repeat(np.cumsum(lens) - lens, lens)
    return out


def block_tiles(slot_lens: Sequence[int] | np.ndarray, pack_len: int, tile: int) -> np.ndarray:
    """int64 ``[ceil(pack_len / tile)]``: live key tiles of each ``tile``-token query block of the global order:
    ``b - f + 1``, ``f`` the key block of the first key of the block's first token (every key block between
    holds a live pair; a block starting in the tail padding: 1; a partial last block counts as flex pads it)."""
    b = np.arange(-(-pack_len // tile), dtype=np.int64)
    return b - first_keys(slot_lens, pack_len)[b * tile] // tile + 1


def ideal_tiles(slot_lens: Sequence[int] | np.ndarray, pack_len: int, tile: int, cp_size: int) -> float:
    """The pack's live tiles at cp 1 (:func:`block_tiles` summed) over ``cp_size``: an even share, the
    denominator of every ``tiles_max_over_ideal``."""
    return float(block_tiles(slot_lens, pack_len, tile).sum()) / cp_size


def _max_per_key(key: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int64 ``(keys, maxima, counts)``: the distinct ``key`` values (sorted), the largest ``value`` and the number
    of entries of each (one ``lexsort``)."""
    order = np.lexsort((value, key))
    key, value = key[order], value[order]
    last = np.flatnonzero(np.diff(key, append=-1))
    return key[last], value[last], np.diff(last, prepend=-1)


def live_tiles(rows: np.ndarray, slot_lens: Sequence[int] | np.ndarray, pack_len: int, tile: int) -> np.ndarray:
    """int64 ``[cp]``: live ``tile x tile`` tiles of each rank's queries (``rows`` int64 ``[cp, L]``, local order)
    x global keys: per query block, the union of its queries' key-block ranges ``first_key // tile .. q // tile``."""
    rows = np.asarray(rows, dtype=np.int64)
    cp, local = rows.shape
    first = first_keys(slot_lens, pack_len)
    q = rows.reshape(-1)
    per_block = -(-local // tile)  # a rank's partial last query block stays its own
    qblock = (np.arange(cp, dtype=np.int64)[:, None] * per_block + np.arange(local, dtype=np.int64) // tile).reshape(-1)
    lo, hi = first[q] // tile, q // tile  # key-block range [lo, hi] of every query
    n_k = -(-pack_len // tile) + 1
    key, hi, _ = _max_per_key(qblock * n_k + lo, hi)  # per (query block, lo): the largest hi
    qb, lo = np.divmod(key, n_k)
    # union length of [lo, hi] intervals sorted by (query block, lo): running max of hi within the block
    run = np.maximum.accumulate(qb * n_k + hi) - qb * n_k
    prev = np.concatenate([[-1], run[:-1]])
    prev[np.flatnonzero(np.diff(qb, prepend=-1))] = -1  # the first interval of each query block
    fresh = np.maximum(0, hi - np.maximum(lo - 1, prev))
    return np.bincount(qb // per_block, fresh, minlength=cp).astype(np.int64)


def kv_recv_tokens(rows: np.ndarray, slot_lens: Sequence[int] | np.ndarray, pack_len: int) -> np.ndarray:
    """int64 ``[cp]``: keys each rank needs and does not own: per slot ``d`` with a query on rank ``r``,
    ``max_q(r, d) - start(d) + 1`` keys less those ``r`` owns (tail padding needs none)."""
    rows = np.asarray(rows, dtype=np.int64)
    cp, local = rows.shape
    slot, starts = segment_starts(slot_lens, pack_len)
    k = starts.size
    q = rows.reshape(-1)
    real = q < _lengths_in_pack(slot_lens, pack_len, "slot_lens")[1]
    key = np.repeat(np.arange(cp, dtype=np.int64), local) * k + slot[q]
    key, last_q, owned = _max_per_key(key[real], q[real])  # per (rank, slot)
    return np.bincount(key // k, last_q - starts[key % k] + 1 - owned, minlength=cp).astype(np.int64)


def exchange_tiles(rows: np.ndarray, slot_lens: Sequence[int] | np.ndarray, pack_len: int, tile: int,
                   plan: ExchangePlan) -> np.ndarray:  # fmt: skip
    """int64 ``[cp]``: :func:`live_tiles` over the keys the exchange leaves each rank: its own ``L`` in local
    order, then ``plan.rank(r).recv_positions()`` (a tile is live when some document has a query in its query
    block at or after a key in its key block)."""
    rows = np.asarray(rows, dtype=np.int64)
    cp, local = rows.shape
    slot, _ = segment_starts(slot_lens, pack_len)
    end = _lengths_in_pack(slot_lens, pack_len, "slot_lens")[1]
    out = np.zeros(cp, dtype=np.int64)
    for r in range(cp):
        q = rows[r]
        keys = np.concatenate([q, plan.rank(r).recv_positions()])
        n_k = -(-keys.shape[0] // tile)
        real_q = np.flatnonzero(q < end)
        real_k = np.flatnonzero(keys < end)
        # max query position per (document, query block), min key position per (document, key block)
        qp, kp = q[real_q], keys[real_k]
        qkey, qp, _ = _max_per_key(slot[qp] * n_k + real_q // tile, qp)
        kkey, kp, _ = _max_per_key(slot[kp] * n_k + real_k // tile, -kp)
        kp = -kp
        # join on the document: every (query block, key block) pair of each document
        q_doc, k_doc = qkey // n_k, kkey // n_k
        lo, hi = k_doc.searchsorted(q_doc, side="left"), k_doc.searchsorted(q_doc, side="right")
        count = hi - lo
        at = np.repeat(np.arange(q_doc.shape[0]), count)
        k_at = segments(lo, count)
        live = kp[k_at] <= qp[at]
        pairs = (qkey[at] % n_k)[live] * n_k + (kkey[k_at] % n_k)[live]
        pad_blocks = np.unique(np.flatnonzero(q >= end) // tile)
        out[r] = np.union1d(pairs, pad_blocks * n_k + pad_blocks).shape[0]
    return out


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


def kept_queries(pos: np.ndarray, end: np.ndarray) -> int:
    """The leading local queries a varlen kernel runs: up to the last real one (``pos < end``; ``pos``, ``end``
    int64 ``[L]``, each token's global position and its slot's real end). The rest, the rank's trailing pad,
    is not run: its output is zeros, what flash gives a query with no key (the loss never reads pad)."""
    real = np.flatnonzero(np.asarray(pos) < np.asarray(end))
    return int(real[-1]) + 1 if real.size else 0


def pad_cut_runs(pos: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first [N], length [N], lo [N])`` int64: the varlen segments of local queries ``pos`` (int64 ``[L]``,
    slot starts ``start``, real ends ``end``) and the global position of each one's first key: a real run
    (:func:`query_runs`) sees its slot from its start, a run of pad (``pos >= end``) is cut into pieces of at
    most :data:`PAD_CHUNK` queries over their own keys (one diagonal tile each at ``tile >= PAD_CHUNK``)."""
    pos, end = np.asarray(pos, dtype=np.int64).reshape(-1), np.asarray(end, dtype=np.int64).reshape(-1)
    start = np.where(pos < end, np.asarray(start, dtype=np.int64).reshape(-1), end)  # pads: a run from the end
    first, length = query_runs(pos, start)
    is_pad = pos[first] >= end[first]
    pieces = np.where(is_pad, -(-length // PAD_CHUNK), 1)
    run = np.repeat(np.arange(first.size), pieces)
    k = segments(np.zeros_like(pieces), pieces)  # piece index inside its run (0 for a real run)
    first = first[run] + k * PAD_CHUNK
    length = np.where(is_pad[run], np.minimum(PAD_CHUNK, length[run] - k * PAD_CHUNK), length[run])
    return first, length, np.where(is_pad[run], pos[first], start[first])


def varlen_live_tiles(rows: np.ndarray, slot_lens: Sequence[int] | np.ndarray, pack_len: int, tile: int, *,
                      pad_free: bool = False) -> np.ndarray:  # fmt: skip
    """int64 ``[cp]``: live tiles each rank's varlen segments pay; ``rows`` int64 ``[cp, L]``
    (:func:`cpdata.layout.maps.rank_indices`; ``arange(pack_len)[None]``: every slot one segment).
    ``pad_free``: the pack's tail after the slots is pad, run as :mod:`cpdata.device.varlen` runs it: a rank's
    trailing pad (the suffix of its local order past the last real token, :func:`kept_queries`) costs nothing,
    any other run of pad is cut into segments of at most :data:`PAD_CHUNK` queries over their own keys
    (:func:`pad_cut_runs`: one diagonal tile each at ``tile >= PAD_CHUNK``); else the tail counts as one more
    document."""
    rows = np.asarray(rows, dtype=np.int64)
    slot, starts = segment_starts(slot_lens, pack_len)
    real_end = np.full(rows.shape[1], int(np.sum(slot_lens)), dtype=np.int64)
    out = np.zeros(rows.shape[0], dtype=np.int64)
    for rank, pos in enumerate(rows):
        if pad_free:
            pos = pos[: kept_queries(pos, real_end)]
            first, length, lo = pad_cut_runs(pos, starts[slot[pos]], real_end[: pos.size])
        else:
            first, length = query_runs(pos, starts[slot[pos]])
            lo = starts[slot[pos[first]]]
        out[rank] = int(segment_tiles(length, pos[first + length - 1] - lo + 1, tile).sum())
    return out
