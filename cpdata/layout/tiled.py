"""Layout ``tiled``: whole ``tile``-token blocks of the pack, dealt to balance the tiles a kernel computes.

Each rank gets ``n / cp`` of the pack's ``n = S / tile`` blocks, in increasing order (a span table,
:mod:`cpdata.layout.spans`: a row or the inverse is one ``repeat`` and one add). Block ``b`` costs ``b -
first_block(its document) + 1`` live tiles whoever owns the others (:func:`cpdata.layout.tiles.block_tiles`),
so the deal splits the pack's tiles into ``cp`` equal sums of ``m = n / cp`` blocks, keeping small the most
K/V a rank receives (a document's keys up to its last block there); in prose: docs/layouts-and-kernels.md.

1. :func:`block_groups`: each document's blocks; one longer than ``m`` is cut at :data:`HEAD_FRACTION`.
2. The groups' dense tails densest first, then the heads mirrored, every piece tail first.
3. :func:`deal_blocks`: each rank takes the blocks from both ends closest to an equal share (:func:`_adjust`).
4. :func:`swap_blocks` while the busiest rank is over :data:`SWAP_TOLERANCE`, weighing the K/V received.
5. :func:`resplit_pairs` (``m <= RESPLIT_BLOCKS``): the best re-split of a pair of ranks' blocks.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from cpdata.layout.runs import _arange, _frozen, _per_pack, first_of_runs
from cpdata.layout.spans import SpanBlock

__all__ = ["CUT_TOLERANCE", "DEFAULT_TILE", "HEAD_FRACTION", "MAX_PAIRS", "MAX_SWAPS", "RESPLIT_BLOCKS",
           "SWAP_TOLERANCE", "TILES", "block_groups", "deal_blocks", "resplit_pairs", "swap_blocks",
           "tiled_block", "tiled_owners"]  # fmt: skip

TILES: tuple[int, ...] = (64, 128, 256)
"""Tile sizes ``tiled`` supports (the kernel's query and key block: 128 for flash/flex on most GPUs, 256 on newer)."""

DEFAULT_TILE = 128

HEAD_FRACTION = 0.7
"""Where a long group is cut: at its first block costing this fraction of the pack's mean block (0.5 and 1.0
land within 0.02 of it on the K/V received; no cut: 0.03-0.05 more)."""

CUT_TOLERANCE = 0.0025
"""A cut that misses its share by more than this fraction of it tries the fine cut (step 3)."""

SWAP_TOLERANCE = 0.005
"""Swaps stop once the busiest rank is within this fraction of the ideal."""

MAX_SWAPS = 32

MAX_PAIRS = 4096
"""Swaps weigh every pair of the busiest rank's blocks and the others' up to this many pairs, else the first and
last blocks of runs, then those with the idlest rank (the same tiles and K/V on the bench's rows)."""

RESPLIT_BLOCKS = 4
"""Pairwise re-splits run where a rank holds at most this many blocks (``C(8, 4) = 70`` splits a pair)."""


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


def block_groups(slot_lens: np.ndarray, pack_len: int, tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first, size, c0)`` int64 ``[G]``: the blocks ``first .. first + size - 1`` whose first token lies in each
    slot, costing ``c0, c0 + 1, ...`` live tiles; then each block starting in the tail padding, costing 1."""
    d = slot_lens.shape[0]
    bounds = np.zeros(d + 1, dtype=np.int64)
    slot_lens.cumsum(out=bounds[1:])  # (methods, not np.cumsum & co: no Python-level dispatch)
    starts = (bounds + (tile - 1)) // tile
    first, size, c0 = starts[:-1], starts[1:] - starts[:-1], starts[:-1] - bounds[:-1] // tile + 1
    pad = _arange(pack_len // tile)[starts[-1] :]  # blocks that start in the tail
    if pad.shape[0] == 0:
        return first, size, c0
    ones = np.ones(pad.shape[0], dtype=np.int64)
    return np.concatenate([first, pad]), np.concatenate([size, ones]), np.concatenate([c0, ones])


def _sequence(first: np.ndarray, size: np.ndarray, c0: np.ndarray, n: int, m: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Steps 1-2: int64 ``[n]`` block, cost and end of its piece, of every sequence position."""
    dense = 2 * c0 + size  # a piece's doubled mean cost, plus one
    order = None
    if first.shape[0] > 1 and size.max() > m:  # (one document: its tail first and head last already pair up)
        k = math.ceil(HEAD_FRACTION * int(((dense - 1) * size).sum()) / (2 * n)) - c0  # first block costing that
        at = ((size > m) & (k > 0) & (k < size)).nonzero()[0]
        if at.shape[0]:
            k = k[at]
            heads = first[at], c0[at]
            first, size, c0 = first.copy(), size.copy(), c0.copy()  # the cut groups' tails in their place
            first[at] += k
            size[at] -= k
            c0[at] += k
            order = (first - (2 * c0 + size) * n).argsort()
            cut = np.zeros(first.shape[0], dtype=bool)
            cut[at] = True
            # the heads go last, in the reverse order of their tails: the rank that takes a tail from the dense
            # end takes its head from the sparse end, and needs only the keys between the two
            back = at.searchsorted(order[cut[order]][::-1])
            first = np.concatenate([first[order], heads[0][back]])
            size = np.concatenate([size[order], k[back]])
            c0 = np.concatenate([c0[order], heads[1][back]])
    if order is None:
        order = (first - dense * n).argsort()  # densest first, then in global order
        first, size, c0 = first[order], size[order], c0[order]
    end = size.cumsum()
    back = _arange(n)
    seq = (first + end - 1).repeat(size) - back  # tail first: a piece's i-th position holds its block size - 1 - i
    return seq, seq + (c0 - first).repeat(size), end.repeat(size)


def deal_blocks(first: np.ndarray, size: np.ndarray, c0: np.ndarray, n: int, cp: int
                ) -> tuple[np.ndarray, list[int]]:  # fmt: skip
    """Steps 1-3 for ``n`` blocks: ``(owner int64 [n], loads)``: every block's rank and every rank's live tiles."""
    m = n // cp
    seq, cost, piece_end = _sequence(first, size, c0, n, m)
    cs = np.zeros(n + 1, dtype=np.int64)
    cost.cumsum(out=cs[1:])
    lo, hi, left = 0, n, int(cs[n])
    took, loads = [], []
    for r in range(cp - 1):
        share = left / (cp - r)
        # x from the dense end and m - x from the sparse end cost cs[lo + x] - cs[lo] + cs[hi] - cs[hi - m + x]
        gap = cs[lo : lo + m + 1] - cs[hi - m : hi + 1] + (left - share)  # float64 [m + 1]: cost - share
        miss = np.abs(gap)
        x = int(miss.argmin())
        if miss[x] <= max(CUT_TOLERANCE * share, 0.5) or m == 1:  # (0.5: no whole x does better)
            load = round(share + gap[x])
        else:
            x = _adjust(x, gap, miss, cost, seq, cs, piece_end, lo, hi, m)
            load = int(cs[lo + x] - cs[lo] + cs[hi] - cs[hi - m + x])
        took.append(x)
        loads.append(load)
        lo, hi, left = lo + x, hi - m + x, left - load
    loads.append(left)
    counts = np.array([*took, m, *(m - x for x in reversed(took))], dtype=np.int64)
    owner = np.empty(n, dtype=np.int64)
    owner[seq] = _snake(cp).repeat(counts)
    return owner, loads


def _adjust(x: int, gap: np.ndarray, miss: np.ndarray, cost: np.ndarray, seq: np.ndarray, cs: np.ndarray,
            piece_end: np.ndarray, lo: int, hi: int, m: int) -> int:  # fmt: skip
    """Step 3's fine cut: ``y`` dense blocks, ``m - y - 1`` sparse ones and block ``q = lo + y + round(gap[y +
    1])`` of the dense run's piece, moved to position ``lo + y``; returns ``y + 1``, or ``x`` if no better."""
    at = _arange(cs.shape[0])
    e = at[lo + 1 : lo + m]  # y = 1 .. m - 1: the first position after the dense run
    shift = np.rint(gap[2:]).astype(np.int64)
    q = e + shift
    fine = np.abs(gap[2:] - shift)
    below = np.minimum(piece_end[lo : lo + m - 1], at[hi - m + 2 : hi + 1])  # the run's piece, the sparse run
    fine[(shift < 0) | (q >= below)] = np.inf
    j = int(fine.argmin())
    if fine[j] >= miss[x]:
        return x
    e, q = lo + 1 + j, int(q[j])
    seq[e], seq[q] = seq[q], seq[e]
    step = int(cost[q]) - int(cost[e])
    cost[e], cost[q] = cost[q], cost[e]
    cs[e + 1 : q + 1] += step
    return j + 2


@functools.lru_cache(maxsize=16)
def _snake(cp: int) -> np.ndarray:
    """int64 ``[2cp - 1]``: ``0 .. cp-1 .. 0``, the owner of each of the deal's segments (cached)."""
    ranks = np.arange(cp, dtype=np.int64)
    return np.concatenate([ranks, ranks[-2::-1]])


def swap_blocks(first: np.ndarray, size: np.ndarray, c0: np.ndarray, owner: np.ndarray, cp: int,
                loads: list[int]) -> None:  # fmt: skip
    """Step 4, in place on ``owner`` (int64 ``[n]``; ``loads``: every rank's live tiles)."""
    n, groups = owner.shape[0], first.shape[0]
    m = n // cp
    total = sum(loads)
    limit = total / cp * (1 + SWAP_TOLERANCE)
    if max(loads) <= limit:
        return
    limit = max(limit, -(-total // cp), int((c0 + size - 1).max()))  # no deal of whole blocks goes below these
    load = np.array(loads, dtype=np.int64)
    gid = np.arange(groups, dtype=np.int64).repeat(size)
    pos = _arange(n) - first[gid]
    reach_of = pos + 1  # a rank holding the block needs its document's keys up to it
    cost = c0[gid] + pos
    for _ in range(MAX_SWAPS):
        a = int(load.argmax())
        if load[a] <= limit:
            return
        key = owner * groups + gid
        reach = np.zeros(cp * groups, dtype=np.int64)
        np.maximum.at(reach, key, reach_of)
        recv = reach.reshape(cp, groups).sum(axis=1) - m  # blocks a rank needs and does not hold
        by = key.argsort(kind="stable")
        same = key[by[1:]] == key[by[:-1]]
        prev = np.full(n, -1, dtype=np.int64)  # the rank's previous block of the document, -1: none
        prev[by[1:][same]] = pos[by[:-1][same]]
        mine = owner == a
        ia, ib = mine.nonzero()[0], (~mine).nonzero()[0]
        if ia.shape[0] * ib.shape[0] > MAX_PAIRS:  # the first and last blocks of runs (of a rank and document)
            opens = first_of_runs(key)
            edge = opens | np.append(opens[1:], True)
            ia, ib = ia[edge[ia]], ib[edge[ib]]
            if ia.shape[0] * ib.shape[0] > MAX_PAIRS:  # with the idlest rank's
                ib = ib[owner[ib] == int(load.argmin())]
        b = owner[ib]
        reach_a = reach[a * groups + gid[ib]]
        reach_b = reach[b[None, :] * groups + gid[ia][:, None]]
        da = _given(ia, reach[key[ia]], reach_of, prev)[:, None] + (np.maximum(reach_a, reach_of[ib]) - reach_a - 1)
        db = np.maximum(reach_b, reach_of[ia][:, None]) - reach_b - 1 + _given(ib, reach[key[ib]], reach_of, prev)
        delta = cost[ia][:, None] - cost[ib]
        after = np.maximum(load[a] - delta, load[b] + delta)
        rest = np.where(_arange(cp) == a, -1, recv)  # the most any third rank receives, for each partner
        top = int(rest.argmax())
        third = np.full(cp, rest[top])
        third[top] = max(int(np.delete(rest, top).max()), 0)
        worst = np.maximum(np.maximum(recv[a] + da, recv[b] + db), third[b])
        fit = (delta > 0) & (after <= limit)
        ok = fit if fit.any() else (delta > 0) & (after < load[a])
        if not ok.any():
            return
        score = np.where(ok, worst * (2 * int(load[a]) + 1) + after, np.iinfo(np.int64).max)
        i, j = divmod(int(score.argmin()), ib.shape[0])
        x, z, r = int(ia[i]), int(ib[j]), int(b[j])
        owner[x], owner[z] = r, a
        load[a] -= delta[i, j]
        load[r] += delta[i, j]


def _given(x: np.ndarray, reach: np.ndarray, reach_of: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """Change in what a block's owner receives when it gives the block away: a hole (+1) inside its reach,
    or, for its last block of the document, the reach falling back to its previous one."""
    return np.where(reach_of[x] == reach, prev[x] + 2 - reach, 1)


@functools.lru_cache(maxsize=8)
def _splits(m: int) -> np.ndarray:
    """int64 ``[C(2m, m), 2m]``: every choice of ``m`` of ``2m`` blocks, as 0/1 rows (read-only, cached)."""
    rows = np.zeros((math.comb(2 * m, m), 2 * m), dtype=np.int64)
    np.put_along_axis(rows, np.array(list(itertools.combinations(range(2 * m), m))), 1, axis=1)
    _frozen(rows)
    return rows


def resplit_pairs(first: np.ndarray, size: np.ndarray, c0: np.ndarray, owner: np.ndarray, cp: int) -> None:
    """Step 5, in place on ``owner`` (int64 ``[n]``, ``m = n / cp <= RESPLIT_BLOCKS``)."""
    n = owner.shape[0]
    m = n // cp
    if cp < 2 or m < 2:
        return
    cost = (c0 - first).repeat(size) + _arange(n)
    splits = _splits(m)
    pairs = np.array(list(itertools.combinations(range(cp), 2)), dtype=np.int64)
    for _ in range(4 * cp):
        held = owner.argsort(kind="stable").reshape(cp, m)
        load = cost[held].sum(axis=1)
        both = np.concatenate([held[pairs[:, 0]], held[pairs[:, 1]]], axis=1)  # [pairs, 2m]
        la = cost[both] @ splits.T  # [pairs, splits]
        lb = (load[pairs[:, 0]] + load[pairs[:, 1]])[:, None] - la
        gain = (load[pairs[:, 0]] ** 2 + load[pairs[:, 1]] ** 2)[:, None] - la * la - lb * lb
        gain[np.maximum(la, lb) > load.max()] = 0
        k = int(gain.argmax())
        if gain.flat[k] <= 0:
            return
        p, s = divmod(k, splits.shape[0])
        owner[both[p][splits[s] == 1]] = pairs[p, 0]
        owner[both[p][splits[s] == 0]] = pairs[p, 1]
