"""Layout ``tiled``: whole ``tile``-token blocks of the pack, dealt to balance the tiles a kernel computes.

The pack's global order is cut into ``n = S / tile`` blocks; every rank gets
``m = n / cp`` of them, in increasing global order (``S`` a multiple of
``cp * tile``; documents need no padding). A rank's query block is then one
block of the global order, whose live key tiles under the document-causal
mask do not depend on who owns the other blocks:
``cost[b] = b - first_block(document of b's first token) + 1``
(:func:`cpdata.layout_tiles.block_tiles`). A rank pays the sum of its blocks'
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
busiest rank's tiles within ~1 % of the ideal at tile 128 on every distribution
row; K/V a rank must receive 0.02-0.35 of an all-gather's; ~40-200 us per pack.
The run table (:func:`tiled_block`) is the blocks themselves: one row per
block, two columns (the block, and an empty run picked by every other rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.layout_runs import RunBlock, _frozen, segments

__all__ = ["DEFAULT_TILE", "MAX_SWAPS", "SWAP_TOLERANCE", "TILES", "block_costs", "tiled_block", "tiled_owners"]

TILES: tuple[int, ...] = (64, 128, 256)
"""Tile sizes ``tiled`` supports (the kernel's query and key block: 128 for flash/flex on most GPUs, 256 on newer)."""

DEFAULT_TILE = 128

SWAP_TOLERANCE = 0.005
"""Swaps stop once the busiest rank is within this fraction of the ideal (each swap moves blocks off their
document's rank; the deal alone is within ~1 %)."""

MAX_SWAPS = 16

PIECE_DIVISOR = 1
"""Documents longer than ``m / PIECE_DIVISOR`` blocks are dealt as consecutive pieces of that many blocks (1:
measured lowest K/V received on long_context, 0.49-0.51 of an all-gather against 0.53-0.55 with 2; balance the
same)."""


def block_costs(slot_lens: np.ndarray, pack_len: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cost, doc)`` int64 ``[pack_len // tile]``: each block's live key tiles and the slot of its first token.

    ``slot_lens`` int64 ``[D]`` summing to at most ``pack_len`` (the tail joins the last slot).
    """
    n = pack_len // tile
    ends = np.cumsum(slot_lens)
    if ends.size:
        ends[-1] = pack_len
    else:
        ends = np.array([pack_len], dtype=np.int64)
    b = np.arange(n, dtype=np.int64)
    doc = ends.searchsorted(b * tile, side="right")
    starts = np.concatenate([[0], ends[:-1]])
    return b - starts[doc] // tile + 1, doc


def _deal(cost: np.ndarray, doc: np.ndarray, cp: int) -> np.ndarray:
    """int64 ``[n]``: the owner of every block (steps 1-3 of the module docstring)."""
    n = cost.shape[0]
    m = n // cp
    first = np.flatnonzero(np.diff(doc, prepend=-1))  # each group's first block
    size = np.diff(first, append=n)
    piece = max(1, m // PIECE_DIVISOR)
    if size.max() > piece:  # long documents: consecutive pieces of `piece` blocks, each its own group
        cuts = np.zeros(n, dtype=bool)
        cuts[first] = True
        within = np.arange(n, dtype=np.int64) - np.repeat(first, size)
        cuts[within % piece == 0] = True
        first = np.flatnonzero(cuts)
        size = np.diff(first, append=n)
    gcost = np.add.reduceat(cost, first)
    order = np.lexsort((first, -gcost / size))  # densest first, ties in global order
    seq = segments(first[order], size[order])
    cs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(cost[seq], out=cs[1:])
    lo, hi = 0, n
    x = np.arange(m + 1, dtype=np.int64)
    took = np.empty(cp - 1, dtype=np.int64)  # blocks each rank takes from the dense end
    for r in range(cp - 1):
        share = (cs[hi] - cs[lo]) / (cp - r)
        got = cs[lo + x] - cs[lo] + cs[hi] - cs[hi - m + x]
        k = int(np.abs(got - share).argmin())
        took[r] = k
        lo, hi = lo + k, hi - m + k
    # the sequence, in order: rank 0's dense blocks .. rank cp-2's, the last rank's middle, rank cp-2's sparse
    # blocks .. rank 0's
    ranks = np.arange(cp, dtype=np.int64)
    counts = np.concatenate([took, [hi - lo], m - took[::-1]])
    owner = np.empty(n, dtype=np.int64)
    owner[seq] = np.concatenate([ranks, ranks[-2::-1]]).repeat(counts)
    return owner


def _swap(cost: np.ndarray, owner: np.ndarray, cp: int) -> None:
    """Step 4: swaps between the busiest and the idlest rank, in place."""
    load = np.bincount(owner, cost, minlength=cp).astype(np.int64)
    ideal = load.sum() / cp
    for _ in range(MAX_SWAPS):
        a, b = int(load.argmax()), int(load.argmin())
        gap = int(load[a] - load[b])
        if load[a] <= ideal * (1 + SWAP_TOLERANCE) or gap < 2:
            return
        on_a, on_b = np.flatnonzero(owner == a), np.flatnonzero(owner == b)
        cb = cost[on_b]
        by = np.argsort(cb, kind="stable")
        cb = cb[by]
        # for each block of a, the block of b whose cost is nearest cost_a - gap / 2
        want = 2 * cost[on_a] - gap
        j = np.clip(np.searchsorted(2 * cb, want), 1, cb.size - 1)
        j = np.where(np.abs(2 * cb[j - 1] - want) <= np.abs(2 * cb[j] - want), j - 1, j)
        delta = cost[on_a] - cb[j]
        after = np.maximum(load[a] - delta, load[b] + delta)
        after = np.where((delta > 0) & (delta < gap), after, load[a])
        i = int(after.argmin())
        if after[i] >= load[a]:
            return
        ia, ib = on_a[i], on_b[by[j[i]]]
        owner[ia], owner[ib] = b, a
        load[a] -= delta[i]
        load[b] += delta[i]


def tiled_owners(slot_lens: Sequence[int] | np.ndarray, pack_len: int, cp_size: int, tile: int) -> np.ndarray:
    """int64 ``[pack_len // tile]``: the rank owning each block (validated lengths, ``pack_len % (cp*tile) == 0``)."""
    lens = np.asarray(slot_lens, dtype=np.int64).reshape(-1)
    cost, doc = block_costs(lens, pack_len, tile)
    if cp_size == 1 or cost.shape[0] == 0:
        return np.zeros(cost.shape[0], dtype=np.int64)
    owner = _deal(cost, doc, cp_size)
    _swap(cost, owner, cp_size)
    return owner


class TiledRunBlock(RunBlock):
    """A :class:`~cpdata.layout_runs.RunBlock` whose rows are ``tile``-token blocks (see :func:`tiled_block`);
    its causal work comes from the packs' slot lengths, kept beside the tables."""

    __slots__ = ("tile", "slot_lens", "slot_counts", "owners")

    def doc_counts(self) -> list[int]:
        """Slots of each pack (its table rows are blocks, not documents)."""
        return self.slot_counts.tolist()

    def causal_work(self, real: np.ndarray) -> np.ndarray:
        """float64 ``[P, cp]``: causal document-masked work per rank (a real token at document offset ``o``
        costs ``o + 1``, padding 0); ``real`` int64 ``[N]``: real tokens of each slot, pack after pack."""
        lens, counts, p, tile, cp = self.slot_lens, self.slot_counts, self.pack_len, self.tile, self.cp_size
        n_packs = counts.shape[0]
        real = np.asarray(real, dtype=np.int64)
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
        keys = self.owners + np.repeat(np.arange(n_packs, dtype=np.int64) * cp, nb)
        return (np.bincount(keys, per_block, minlength=n_packs * cp) / 2).reshape(n_packs, cp)


def tiled_block(lens: np.ndarray, counts: np.ndarray | None, pack_len: int, cp_size: int, tile: int) -> RunBlock:
    """``tiled`` run tables of ``P`` packs (``lens`` int64 ``[N]`` checked slot lengths, ``counts`` int64 ``[P]``
    slots per pack, None: one pack).

    Row ``b`` of a pack's table is block ``b``: column 0 the block (``tile`` tokens, its owner), column 1 an empty
    run; rank ``r`` picks column 0 of its own blocks and column 1 of every other (``pick_key`` = owner). Block
    ``b`` is the ``j``-th block of its owner's row, so its inverse shift is ``tile * (owner * m + j - b)``.
    """
    sizes_per_pack = [lens.shape[0]] if counts is None else counts.tolist()
    packs = np.split(lens, np.cumsum(sizes_per_pack)[:-1]) if counts is not None else [lens]
    nb, cp = pack_len // tile, cp_size
    owners = np.concatenate([tiled_owners(pack, pack_len, cp, tile) for pack in packs])
    n_packs = len(packs)
    by_rank = np.argsort(owners.reshape(n_packs, nb), axis=1, kind="stable")  # [P, nb]: row order, rank-major
    place = np.empty_like(by_rank)
    np.put_along_axis(place, by_rank, np.arange(nb, dtype=np.int64)[None, :].repeat(n_packs, 0), axis=1)
    inv = np.zeros((n_packs * nb, 2), dtype=np.int64)
    inv[:, 0] = (tile * (place - np.arange(nb, dtype=np.int64))).reshape(-1)
    sizes = np.zeros((n_packs * nb, 2), dtype=np.int64)
    sizes[:, 0] = tile
    ranks = np.repeat(owners, 2).reshape(-1, 2)
    picks = (1 - np.eye(cp, dtype=np.int64)).reshape(cp, cp, 1)
    _frozen(inv, sizes, ranks, picks)
    block = TiledRunBlock(pack_len, cp, None if counts is None else np.full(n_packs, nb, dtype=np.int64), sizes,
                          inv, ranks, picks, pick_key=owners)  # fmt: skip
    block.tile, block.owners = tile, owners
    block.slot_lens = lens
    block.slot_counts = np.asarray(sizes_per_pack, dtype=np.int64)
    return block
