"""What a block-sparse kernel pays per CP rank: live tiles, and the K/V a rank must receive.

The mask is cpdata's document-causal one (:mod:`cpdata.device.attention_masks`): a
query at global position ``q`` attends to key ``k`` when both lie in the same
document slot and ``k <= q``. The pack's tail padding (``pack_len -
sum(slot_lens)``) is no document: a pad query attends to its own key only, so
it costs one diagonal tile per pad block and needs no key from another rank
(TE's slot tables still let the last slot absorb the tail,
:func:`cpdata.layout.maps.thd_slot_lens`; the mask does not). A rank's
queries are its row in local order, cut into ``tile``-token query blocks; the
keys are the pack's ``S`` positions in global order, cut into ``tile``-token
key blocks. A tile (query block, key block) is live when any of its pairs
attends: flash / flex / FA-style kernels pay every live tile in full, whether
one pair in it is live or all ``tile * tile``.

- :func:`live_tiles`: live tiles per rank, for any layout's rows. It equals
  ``kv_num_blocks + full_kv_num_blocks`` summed over a flex ``BlockMask``
  built by :func:`cpdata.device.attention_masks.flex_block_mask` with
  ``block_size=tile`` (a test checks it on random packs).
- :func:`block_tiles`: the same count for one query block of the pack's global
  order, ``b - first_block(document of b's first token) + 1``: a layout made
  of whole aligned blocks (``tiled``) pays the sum of its blocks' counts.
- :func:`kv_recv_tokens`: per rank, the keys it does not own but its queries
  need: for every document with a query on the rank, the document's positions
  up to that rank's last query of it, minus the rank's own. An all-gather
  delivers ``(cp - 1) / cp * S`` to every rank; a K/V exchange need move only
  these (the reference an exchange plan is checked against).
- :func:`exchange_tiles`: live tiles per rank when the keys are what a K/V exchange leaves the rank (its own
  in local order, then the received ones in receive order: the ``"cpdata"`` attention's key order with
  ``kv_exchange``), for any layout's rows and its exchange plan.
- :func:`first_keys`: every position's first key (its slot's start; a pad's, itself), the predicate the
  counters and their tests share.

Cost: :func:`live_tiles` and :func:`kv_recv_tokens` sort the ``S`` tokens once
(O(S log S), ~8 ms at 128K); they are for tests, benchmarks and inspection,
not the worker path. :func:`block_tiles` is O(S / tile + D log D).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cpdata.layout.exchange import ExchangePlan

__all__ = ["block_tiles", "exchange_tiles", "first_keys", "kv_recv_tokens", "live_tiles", "segment_starts"]


def _absorbed(slot_lens: Sequence[int] | np.ndarray, pack_len: int) -> np.ndarray:
    """int64 ``[K]``: the slots with the tail padding in the last (no slots: one slot of the whole pack)."""
    lens = np.asarray(slot_lens, dtype=np.int64).reshape(-1)
    total = int(lens.sum())
    if (lens.size and lens.min() < 0) or total > pack_len:
        raise ValueError(f"slot_lens must be >= 0 and sum to at most pack_len={pack_len}, got {lens.tolist()[:16]}")
    if lens.size == 0:
        return np.array([pack_len], dtype=np.int64)
    lens = lens.copy()
    lens[-1] += pack_len - total
    return lens


def segment_starts(slot_lens: Sequence[int] | np.ndarray, pack_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Every token's slot and every slot's start: ``(slot int64 [pack_len], start int64 [K])``.

    The tail padding (``pack_len - sum(slot_lens)``) joins the last slot (with no slots the pack is one), as
    in TE's slot tables; the mask treats it as no document (:func:`first_keys`).
    """
    lens = _absorbed(slot_lens, pack_len)
    return np.repeat(np.arange(lens.size, dtype=np.int64), lens), np.cumsum(lens) - lens


def _real_end(slot_lens: Sequence[int] | np.ndarray, pack_len: int) -> int:
    """Where the tail padding starts: ``sum(slot_lens)`` (checked against ``pack_len``)."""
    lens = np.asarray(slot_lens, dtype=np.int64).reshape(-1)
    total = int(lens.sum())
    if (lens.size and lens.min() < 0) or total > pack_len:
        raise ValueError(f"slot_lens must be >= 0 and sum to at most pack_len={pack_len}, got {lens.tolist()[:16]}")
    return total


def first_keys(slot_lens: Sequence[int] | np.ndarray, pack_len: int) -> np.ndarray:
    """int64 ``[pack_len]``: the first key each query attends to: its slot's start for a document token, the
    query itself for the tail padding (a pad query sees its own key only). Query ``q`` attends to the keys
    ``first_keys[q] <= k <= q``."""
    end = _real_end(slot_lens, pack_len)
    lens = np.asarray(slot_lens, dtype=np.int64).reshape(-1)
    out = np.arange(pack_len, dtype=np.int64)
    out[:end] = np.repeat(np.cumsum(lens) - lens, lens)
    return out


def block_tiles(slot_lens: Sequence[int] | np.ndarray, pack_len: int, tile: int) -> np.ndarray:
    """int64 ``[pack_len // tile]``: live key tiles of each ``tile``-token query block of the global order.

    Block ``b`` holds queries ``[b*tile, (b+1)*tile)``; the documents it meets
    start no earlier than the one holding its first token, whose start lies in
    key block ``f``; every key block ``f..b`` holds a live pair (each earlier
    key of a document precedes all of the block's queries; block ``b`` holds the
    diagonal), none before ``f``. So the count is ``b - f + 1``; a block whose
    first token is tail padding has ``f = b`` (its pads see their own keys): 1.
    """
    if pack_len % tile:
        raise ValueError(f"pack_len={pack_len} must be a multiple of tile={tile}")
    b = np.arange(pack_len // tile, dtype=np.int64)
    return b - first_keys(slot_lens, pack_len)[b * tile] // tile + 1


def live_tiles(rows: np.ndarray, slot_lens: Sequence[int] | np.ndarray, pack_len: int, tile: int) -> np.ndarray:
    """int64 ``[cp]``: live ``tile x tile`` tiles of each rank's queries (its row, local order) x global keys.

    ``rows`` int64 ``[cp, L]`` (:func:`cpdata.layout.maps.rank_indices`), ``L`` a multiple of ``tile`` (flex pads
    a partial last query block; so does this count when it is not). A query ``q`` of slot start ``s`` attends
    key blocks ``s // tile .. q // tile`` (a pad query: ``q // tile`` alone); a query block's live tiles are
    the union of its queries' ranges, counted per block after one sort of the ``(query block, first key
    block)`` pairs.
    """
    rows = np.asarray(rows, dtype=np.int64)
    cp, local = rows.shape
    first = first_keys(slot_lens, pack_len)
    q = rows.reshape(-1)
    per_block = -(-local // tile)  # a rank's partial last query block stays its own
    qblock = (np.arange(cp, dtype=np.int64)[:, None] * per_block + np.arange(local, dtype=np.int64) // tile).reshape(-1)
    lo, hi = first[q] // tile, q // tile  # key-block range [lo, hi] of every query
    n_k = -(-pack_len // tile) + 1
    key = qblock * n_k + lo
    order = np.lexsort((hi, key))
    key, hi = key[order], hi[order]
    last = np.flatnonzero(np.diff(key, append=-1))  # per (query block, lo): the largest hi
    key, hi = key[last], hi[last]
    qb, lo = np.divmod(key, n_k)
    # union length of [lo, hi] intervals sorted by (query block, lo): running max of hi within the block
    run = np.maximum.accumulate(qb * n_k + hi) - qb * n_k
    prev = np.concatenate([[-1], run[:-1]])
    prev[np.flatnonzero(np.diff(qb, prepend=-1))] = -1  # the first interval of each query block
    fresh = np.maximum(0, hi - np.maximum(lo - 1, prev))
    return np.bincount(qb // per_block, fresh, minlength=cp).astype(np.int64)


def kv_recv_tokens(rows: np.ndarray, slot_lens: Sequence[int] | np.ndarray, pack_len: int) -> np.ndarray:
    """int64 ``[cp]``: keys each rank needs and does not own (the document-causal mask; tail padding needs none).

    For rank ``r`` and each slot ``d`` with a query on ``r``: ``max_q(r, d) - start(d) + 1`` keys are needed
    (all of ``d``'s positions up to ``r``'s last query of it), of which ``r`` owns ``owned(r, d)`` (all of them
    at or before that query). Sum over ``d`` of the difference. A pad query needs its own key only.
    """
    rows = np.asarray(rows, dtype=np.int64)
    cp, local = rows.shape
    slot, starts = segment_starts(slot_lens, pack_len)
    k = starts.size
    q = rows.reshape(-1)
    real = q < _real_end(slot_lens, pack_len)
    key = (np.repeat(np.arange(cp, dtype=np.int64), local) * k + slot[q])[real]
    q = q[real]
    order = np.lexsort((q, key))
    key, q = key[order], q[order]
    last = np.flatnonzero(np.diff(key, append=-1))
    owned = np.diff(np.concatenate([[-1], last]))
    need = q[last] - starts[key[last] % k] + 1 - owned
    return np.bincount(key[last] // k, need, minlength=cp).astype(np.int64)


def exchange_tiles(rows: np.ndarray, slot_lens: Sequence[int] | np.ndarray, pack_len: int, tile: int,
                   plan: ExchangePlan) -> np.ndarray:  # fmt: skip
    """int64 ``[cp]``: live ``tile x tile`` tiles of each rank's queries (its row, local order) x the keys the
    exchange leaves it: its own ``L`` keys in local order, then ``plan.rank(r).recv_positions()``.

    Tile ``(query block, key block)`` is live when some document has a query in the one at or after a key in
    the other (the minimum key position per ``(key block, document)`` against the maximum query position per
    ``(query block, document)``, joined on the document); a pad query's only key is its own, at its own local
    index: the diagonal tile. Cost: a sort of each rank's ``L + n_recv`` keys and the join's pairs
    (``query blocks x key blocks`` of each document the rank holds); for tests and benchmarks.
    """
    rows = np.asarray(rows, dtype=np.int64)
    cp, local = rows.shape
    slot, _ = segment_starts(slot_lens, pack_len)
    end = _real_end(slot_lens, pack_len)
    out = np.zeros(cp, dtype=np.int64)
    for r in range(cp):
        q = rows[r]
        keys = np.concatenate([q, plan.rank(r).recv_positions()])
        n_k = -(-keys.shape[0] // tile)
        real_q = np.flatnonzero(q < end)
        real_k = np.flatnonzero(keys < end)
        # max query position per (document, query block), min key position per (document, key block)
        qd, qb, qp = slot[q[real_q]], real_q // tile, q[real_q]
        kd, kb, kp = slot[keys[real_k]], real_k // tile, keys[real_k]
        qkey, kkey = qd * n_k + qb, kd * n_k + kb
        order = np.lexsort((qp, qkey))
        last = np.flatnonzero(np.diff(qkey[order], append=-1))
        qkey, qp = qkey[order][last], qp[order][last]
        order = np.lexsort((kp, kkey))
        head = np.flatnonzero(np.diff(kkey[order], prepend=-1))
        kkey, kp = kkey[order][head], kp[order][head]
        # join on the document: every (query block, key block) pair of each document
        q_doc, k_doc = qkey // n_k, kkey // n_k
        lo, hi = k_doc.searchsorted(q_doc, side="left"), k_doc.searchsorted(q_doc, side="right")
        count = hi - lo
        at = np.repeat(np.arange(q_doc.shape[0]), count)
        k_at = np.repeat(lo - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
        live = kp[k_at] <= qp[at]
        pairs = (qkey[at] % n_k)[live] * n_k + (kkey[k_at] % n_k)[live]
        pad_blocks = np.unique(np.flatnonzero(q >= end) // tile)
        out[r] = np.union1d(pairs, pad_blocks * n_k + pad_blocks).shape[0]
    return out
